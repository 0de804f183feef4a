"""Which work of this process keeps a blocking CUDA stream capturing? (GPU only.)

While one kind of work runs on this thread for a few seconds, a C thread (``legacy_watch.c``, no
GIL) asks the driver every ~10 us whether a call on the legacy stream would join a capture
(``cuStreamIsCapturing(CU_STREAM_LEGACY)`` answers 906 then). A line per kind of work: polls, and
polls answered 906. A kind of work with hits makes any legacy-stream call of another thread fail
with ``cudaErrorStreamCaptureImplicit`` while it runs (docs/decisions.md, "cuDNN deserialization
captures").

    python scripts/capture_probe.py [--seconds 8]
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_log import build_watcher  # this folder (the script's) is on sys.path


class _TwoConvolutions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(32, 64, 3, padding=1)
        self.c2 = nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.c1(x))
        return F.relu(self.c2(y) + y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per kind of work (s)")
    args = parser.parse_args()

    import cudnn

    import fusion_compiler as fc
    from fusion_compiler.backends.cudnn import workers
    from fusion_compiler.backends.cudnn.graph import region_recipe

    lib = build_watcher()
    device = torch.device("cuda")
    torch.ones(1, device=device)  # the primary context exists before the watcher takes it
    net = _TwoConvolutions().to(device, torch.half).eval()
    x = torch.randn(64, 32, 16, 16, device=device, dtype=torch.half)
    spec = fc.compile(net, cache_dir=False).specialize(x)
    recipes = [region_recipe(r) for r in spec.regions]

    def job(recipe: dict) -> dict:
        return {"recipe": recipe, "heuristics": ["A", "FALLBACK"], "mode": "ranked",
                "indices": list(range(6))}

    blobs = [p["blob"] for r in recipes for p in workers.build_candidates(job(r))["plans"]
             if p["blob"]]
    print(f"{torch.cuda.get_device_name()}: {len(recipes)} regions, {len(blobs)} plans")

    def deserializer(stream: torch.cuda.Stream | None):
        handle = cudnn.create_handle()
        if stream is not None:
            cudnn.set_stream(handle=handle, stream=stream.cuda_stream)

        def work() -> None:
            for blob in blobs:
                cudnn.pygraph(handle=handle).deserialize(handle, blob)
        return work

    shapes = iter(range(8, 100_000))

    def torch_conv() -> None:  # a new shape: PyTorch finds and builds its own cuDNN plan
        w = torch.randn(next(shapes), 16, 3, 3, device=device, dtype=torch.half)
        F.conv2d(torch.randn(4, 16, 12, 12, device=device, dtype=torch.half), w, padding=1)

    def new_thread_conv() -> None:
        t = threading.Thread(target=torch_conv)
        t.start()
        t.join()

    def capture() -> None:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            net(x)

    kinds = [
        ("nothing", lambda: time.sleep(0.01)),
        ("deserialize, handle on the legacy stream", deserializer(None)),
        ("deserialize, handle on a torch stream", deserializer(torch.cuda.Stream())),
        ("build plans in this process", lambda: [workers.build_candidates(job(r))
                                                 for r in recipes]),
        ("PyTorch convolution, new shape", torch_conv),
        ("a new thread's first convolution", new_thread_conv),
        ("cudnn.create_handle", cudnn.create_handle),
        ("torch.cuda.graph capture", capture),
    ]
    counts, times = (ctypes.c_long * 4)(), (ctypes.c_double * 256)()
    for name, work in kinds:
        torch.cuda.synchronize()
        lib.watch_start(torch.cuda.current_device())
        start, rounds = time.time(), 0
        while time.time() - start < args.seconds:
            work()
            rounds += 1
        torch.cuda.synchronize()
        lib.watch_read(counts, times)
        lib.watch_stop()
        print(f"{name:42s} {rounds:6d} rounds  {counts[0]:9d} polls  {counts[1]:7d} answered 906"
              f"  ({counts[2]} other errors)", flush=True)


if __name__ == "__main__":
    main()
