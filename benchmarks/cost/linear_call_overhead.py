"""What routing a linear layer through oneDNN costs on the host, per call: the layer's instance forward
(``PackedLinearForward``: its staleness checks, then the packed product) against the bare oneDNN op on the same
packed weight, and ``F.linear`` on the default kernel. A forward of SmolLM2-135M calls about 210 such layers, so a
microsecond here is about 0.2 ms a forward.

    python benchmarks/cost/linear_call_overhead.py [--features 576] [--rows 1] [--calls 20000] [--repeats 5]

The three are timed in rotation, ``--repeats`` times ``--calls`` calls each, in bf16 where oneDNN packs it (else
fp32); prints the median microseconds per call and the wrapper's overhead over the bare op. Prints only.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hf_dflash2.kernels_dflash2 import PackedLinearForward, onednn_available

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--features", type=int, default=576, help="in and out features (SmolLM2-135M: 576)")
parser.add_argument("--rows", type=int, default=1, help="rows a call multiplies (a batch-1 plain step: 1)")
parser.add_argument("--calls", type=int, default=20000)
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
if min(args.features, args.rows, args.calls, args.repeats) < 1:
    parser.error(f"--features {args.features}, --rows {args.rows}, --calls {args.calls} and --repeats "
                 f"{args.repeats} must all be >= 1")
if not onednn_available():
    raise SystemExit("this torch build has no oneDNN linear kernel: nothing to compare")

torch.set_num_threads(2)
layer = torch.nn.Linear(args.features, args.features, bias=False)
try:
    layer = layer.to(torch.bfloat16)
    wrapper = PackedLinearForward(layer)
except RuntimeError:  # this CPU cannot pack bf16
    layer = layer.float()
    wrapper = PackedLinearForward(layer)
x = torch.randn(1, args.rows, args.features, dtype=layer.weight.dtype)
calls = {"PackedLinearForward": wrapper, "bare oneDNN op": wrapper.packed_linear,
         "F.linear (default kernel)": lambda x: F.linear(x, layer.weight)}
seconds = {name: [] for name in calls}
with torch.no_grad():
    for call in calls.values():  # warm-up: oneDNN picks its primitive on the first call
        for _ in range(1000):
            call(x)
    for _ in range(args.repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            for _ in range(args.calls):
                call(x)
            seconds[name].append((time.perf_counter() - started) / args.calls)

median = {name: statistics.median(values) * 1e6 for name, values in seconds.items()}
print(f"{layer.weight.dtype}, {args.rows} x {args.features} -> {args.features}, median of {args.repeats} x "
      f"{args.calls} calls")
for name, value in median.items():
    print(f"{name:28s} {value:7.2f} us/call")
overhead = median["PackedLinearForward"] - median["bare oneDNN op"]
print(f"the wrapper's overhead over the bare op: {overhead:.2f} us/call")
