"""Loss memory on CPU: LM head + cross-entropy forward and backward, naive vs chunked.

    python bench/loss_memory.py [--chunk 512] [--hidden 256]

Real Qwen3 vocabulary size (151,936), a small hidden size, fp32. Each configuration runs in a
fresh process; the figure is the increase of peak RSS during the loss forward+backward (the LM head
weight and the hidden states exist before). The chunked path is measured at 1K-32K tokens; the
naive path at 1K-4K only (at 32K its logits alone would be 20 GB, its peak ~60 GB, more than this
machine has): its 32K figure is a linear fit of the measured points (the fit's residuals are
printed). Time ratio chunked/naive is measured at 4K in the same run. Writes
bench/results/loss_memory.json. Goal (issue 4): chunked <= 1/40 of naive at 32K tokens.
"""

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CHILD = r"""
import resource, sys, time, torch, torch.nn.functional as F
from longsft.train.loss import chunked_cross_entropy
n, hidden, vocab, chunk = (int(x) for x in sys.argv[1:5])
torch.manual_seed(0)
head = torch.nn.Linear(hidden, vocab, bias=False)
h = torch.randn(n, hidden, requires_grad=True)
t = torch.randint(0, vocab, (n,))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
loss = F.cross_entropy(head(h), t, reduction="sum") if chunk == 0 else chunked_cross_entropy(head, h, t, chunk)
loss.backward()
dt = time.perf_counter() - t0
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024, dt, loss.item())
"""


def run(n: int, hidden: int, vocab: int, chunk: int) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(hidden), str(vocab), str(chunk)],
                         capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "2", "PATH": ""})
    peak, dt, _ = out.stdout.split()
    return float(peak), float(dt)


def main() -> None:
    import numpy as np
    from machine import write_result

    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151_936)
    args = ap.parse_args()
    naive = {n: run(n, args.hidden, args.vocab, 0) for n in (1024, 2048, 4096)}
    chunked = {n: run(n, args.hidden, args.vocab, args.chunk) for n in (1024, 4096, 32768)}
    xs = np.array(list(naive))
    ys = np.array([naive[n][0] for n in naive])
    slope, icpt = np.polyfit(xs, ys, 1)
    naive_32k = slope * 32768 + icpt
    gib = 2 ** 30
    print("| tokens | naive peak GiB | chunked peak GiB | naive s | chunked s |\n|---:|---:|---:|---:|---:|")
    for n in (1024, 2048, 4096, 32768):
        nv = f"{naive[n][0] / gib:.2f}" if n in naive else f"{naive_32k / gib:.2f} (fit)"
        ns = f"{naive[n][1]:.2f}" if n in naive else "–"
        cv = f"{chunked[n][0] / gib:.2f}" if n in chunked else "–"
        cs = f"{chunked[n][1]:.2f}" if n in chunked else "–"
        print(f"| {n} | {nv} | {cv} | {ns} | {cs} |")
    ratio = chunked[32768][0] / naive_32k
    residuals = (ys - (slope * xs + icpt)) / ys
    print(f"\nchunked / naive at 32K: 1/{1 / ratio:.0f} (goal <= 1/40); naive fit residuals "
          f"{', '.join(f'{r:+.1%}' for r in residuals)}; time chunked/naive at 4K: "
          f"{chunked[4096][1] / naive[4096][1]:.2f}")
    write_result("loss_memory", {
        "benchmark": "loss_memory", "vocab": args.vocab, "hidden": args.hidden, "chunk": args.chunk,
        "naive_peak_bytes_measured": {str(k): v[0] for k, v in naive.items()},
        "naive_peak_bytes_32k_fit": naive_32k, "chunked_peak_bytes_measured": {str(k): v[0] for k, v in chunked.items()},
        "ratio_32k": ratio, "goal_ratio": 1 / 40, "fit_residuals": residuals.tolist(),
        "time_ratio_chunked_over_naive_4k": chunked[4096][1] / naive[4096][1],
        "note": "naive at 32K does not fit this machine: extrapolated linearly from 1K-4K measurements"})


if __name__ == "__main__":
    main()
