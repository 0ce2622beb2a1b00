"""How graphrt declares its ops: a schema, one body for every backend, and a fake for tracing.

Ops are declared on a ``torch.library.Library`` rather than with ``torch.library.custom_op``: a
``custom_op`` call runs through Python autograd and Dynamo-disabling wrappers every time (and
imports the compiler on its first call, a second of start-up for an engine that only replays
precompiled graphs); a Library op dispatches straight to its body.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LIBRARY = torch.library.Library("graphrt", "FRAGMENT")


def define(schema: str, body: Callable, fake: Callable) -> None:
    """Declare ``graphrt::<schema>`` with ``body`` for every device and ``fake`` for tracing."""
    name = schema.split("(", 1)[0]
    LIBRARY.define(schema)
    LIBRARY.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"graphrt::{name}", fake, lib=LIBRARY)
