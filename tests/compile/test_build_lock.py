"""Package builds of one graph run one at a time across processes (Inductor archives a graph's
shared files outside its own lock), while another graph's build goes on beside them."""

import subprocess
import sys
import textwrap

from graphrt.compiler.aoti import same_graph_lock

# A second process that tries for the lock without waiting: prints whether it got it.
TRY = textwrap.dedent("""
    import fcntl, sys
    from graphrt.compiler import aoti
    held, real = [], fcntl.flock
    def flock(f, op):
        try:
            real(f, op | fcntl.LOCK_NB)
            held.append(True)
        except BlockingIOError:
            held.append(False)
            raise SystemExit(0)
    aoti.fcntl.flock = flock
    with aoti.same_graph_lock(sys.argv[1], sys.argv[2]):
        pass
    print(held[0])
""")


def other_process_gets(code: str, spec: str) -> bool:
    out = subprocess.run([sys.executable, "-c", TRY, code, spec], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def test_a_second_build_of_the_same_graph_waits_and_another_graph_does_not(tmp_path, monkeypatch):
    # arrange
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    code, spec = "def forward(self, x):\n    return x\n", '{"inputs": [[[1, 4], [4, 1], "float32"]]}'
    # act
    with same_graph_lock(code, spec):
        same = other_process_gets(code, spec)
        other_shape = other_process_gets(code, spec.replace("4", "8"))
    after = other_process_gets(code, spec)
    # assert
    assert (same, other_shape, after) == (False, True, True)
