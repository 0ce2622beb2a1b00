"""How often a draft drawn from q is accepted against a target p, under three verification rules
(the numbers in the README's speculative-decoding section): the ratio rule min(1, p/q) accepts
Σ min(p, q); drawing the draft with the target's own uniform (both by inverse CDF in vocabulary
order) accepts where their CDF intervals overlap; an independent one-hot draw accepts Σ p·q.

Run: .venv/bin/python docs/acceptance_rules.py
"""

import torch


def same_uniform(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    cp, cq = torch.cumsum(p, -1), torch.cumsum(q, -1)
    return (torch.minimum(cp, cq) - torch.maximum(cp - p, cq - q)).clamp(min=0).sum(-1)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 49152
    for temp in (0.7, 1.0):
        for sigma in (0.1, 0.3, 1.0, 2.0):
            logits = torch.randn(64, vocab, generator=g, dtype=torch.float64) * 3
            noisy = logits + torch.randn(64, vocab, generator=g, dtype=torch.float64) * sigma
            p, q = torch.softmax(logits / temp, -1), torch.softmax(noisy / temp, -1)
            print(
                f"T={temp} noise={sigma}: ratio rule {torch.minimum(p, q).sum(-1).mean():.3f}  "
                f"same-uniform draws {same_uniform(p, q).mean():.3f}  independent draws {(p * q).sum(-1).mean():.3f}"
            )


if __name__ == "__main__":
    main()
