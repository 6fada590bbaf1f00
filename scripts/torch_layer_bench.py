#!/usr/bin/env python3
"""PyTorch's side of `serve bench layers` (src/bin/serve/bench_layers.rs): the time one batch
takes through torchvision's ResNet or transformers' BertModel on the CPU, with the same thread
count, batch sizes and input shapes as libserve's run, random weights (speed does not depend on
them), eval mode, torch.inference_mode().

`serve bench layers` embeds this file and runs it as `PYTHON - ARGS` (the script on standard
input), so it needs no path; it can also be run by hand:

    python3 scripts/torch_layer_bench.py --model resnet50 --image 3,224,224 --batches 1,8 \
        --threads 2 --min-time 2

Output: one JSON line {"torch": version, "threads": n, "results": [{"batch": b, "ms": median
milliseconds per batch, "rounds": k}, ...]} on standard output. Each batch size runs warm-up
iterations, then rounds of at least --min-time / 5 seconds each; the median round is reported.
For bert, every request has --seq-len tokens (the attention mask all ones), the same work
libserve does for requests of that length.
"""

import argparse
import json
import statistics
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="resnet18|resnet34|resnet50|resnet101|resnet152|bert-base")
    p.add_argument("--image", default="3,224,224")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--min-time", type=float, default=2.0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (FP32, TF32 off)")
    a = p.parse_args()

    import torch

    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(0)
    if a.model.startswith("resnet"):
        import torchvision

        model = getattr(torchvision.models, a.model)(weights=None).eval().to(dev)
        c, h, w = (int(x) for x in a.image.split(","))

        def inputs(b):
            return (torch.randn(b, c, h, w, device=dev),)
    elif a.model == "bert-base":
        from transformers import BertConfig, BertModel

        model = BertModel(BertConfig(attn_implementation="eager")).eval().to(dev)

        def inputs(b):
            ids = torch.randint(1000, 20000, (b, a.seq_len), device=dev)
            return (ids, torch.ones(b, a.seq_len, dtype=torch.long, device=dev))
    else:
        raise SystemExit(f"unknown model {a.model}")

    results = []
    with torch.inference_mode():
        for b in (int(x) for x in a.batches.split(",")):
            x = inputs(b)
            t0 = time.perf_counter()
            model(*x)
            sync()
            once = time.perf_counter() - t0
            for _ in range(2):
                model(*x)
            sync()
            per_round = max(1, int(a.min_time / 5 / max(once, 1e-6)))
            rounds = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(per_round):
                    model(*x)
                sync()
                rounds.append((time.perf_counter() - t0) * 1e3 / per_round)
            results.append({"batch": b, "ms": statistics.median(rounds), "rounds": len(rounds)})
    device = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    print(json.dumps({"torch": torch.__version__, "device": device, "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
