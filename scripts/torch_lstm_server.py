#!/usr/bin/env python3
# libserve's PyTorch peer for `serve bench lstm|seq2seq|treelstm` (issue 19): the bench embeds this
# file (and torch_rnn_models.py, written beside it) and runs it first, at the same request lengths
# and model sizes (seq2seq, treelstm: the same weights and requests), then compares against its JSON.
"""PyTorch peer baseline for `serve bench lstm|seq2seq|treelstm`: served with a dynamic batcher on CPU.

What a user would pick instead of libserve: PyTorch eager (torch.nn.Embedding + torch.nn.LSTM,
batch_first, torch.inference_mode, torch.set_num_threads(2)) behind a dynamic batcher as TorchServe
and Triton do it: a batch runs when it holds --max-batch requests or its oldest request has waited
--max-delay-ms. Output of a request = the final top-layer h of its own sequence (no padding in it).

Variable lengths (--modes):
  pack    FIFO batches, padded to the batch's longest and run with pack_padded_sequence (h_n).
  pad     FIFO batches, padded to the batch's longest, run dense, output gathered at len-1.
  bucket  the TF/MXNet baseline of the BatchMaker paper: requests wait in buckets of
          --bucket-width tokens (1-10, 11-20, ...); a batch takes requests of one bucket (the
          ready bucket with the oldest head), padded to its longest (<= width-1 steps wasted), dense.

--model seq2seq|treelstm (torch_rnn_models.py, beside this file, says how each runs): the bench's
own model (--model-dir: its weights.safetensors) and exact requests (--requests FILE), sizes
--vocab --embed --hidden (--layers --bos --eos --max-decode for seq2seq). Modes: seq2seq `pack`
(FIFO batches; the encoder through pack_padded_sequence) and `bucket` (source-length buckets as
above, packed too), both decoding until the batch's last row ends (ended rows dropped); treelstm
`fifo` (batches by arrival, as a DGL-style server batches trees) and `bucket` (buckets of
--bucket-width nodes). --outputs FILE writes the outputs of the first --check-requests distinct
requests (tokens, or the roots' h) for the bench to compare with libserve's; --check-only stops there.

Workload and measurement, mirroring libserve's src/workload.rs and src/bin/serve/bench{,_rnn}.rs:
  * model: vocab 30000, embed 256, hidden 256, 1 layer, random weights;
  * requests: 4096 distinct WMT-like token sequences cycled in order; lengths log-normal, mean 24,
    sigma 0.7276, rounded, clipped to [1, 330] (--lengths FILE: a JSON list, e.g. the exact
    lengths libserve generates; otherwise sampled here with numpy, same distribution);
  * peak: a saturating closed loop (--window requests in flight, each completion replaced at once)
    for --capacity-s seconds; completions counted after a 20% settling period, over the span from
    the first to the last counted completion;
  * open loop: Poisson arrivals at each rate, n = max(--min-requests, rate * --duration-s), after a
    warm-up; latency from the *scheduled* arrival to the batch's result; throughput = completed /
    (last completion - start); after the last arrival the backlog gets max(span, 1 s), then the
    rest is cancelled and counted in `errors` (percentiles are over completed requests only).

Arrivals (--arrivals): `inline` (default) admits each request at its scheduled instant inside the
serving loop: a zero-cost front end, like Triton's or TorchServe's non-Python frontends, and no
GIL contention; `thread` has a Python client thread submit each request at its instant into a
locked queue, as an in-process Python server would.

Procedure: (1) peak of every grid configuration (--modes x --max-batch x --max-delay-ms);
(2) screen: each configuration at half of the best peak for --screen-s seconds (those it would
overload are skipped); (3) rank: configurations within --peak-tolerance of the best peak by
screened p90, then the rest by peak; the first is the best; (4) sweep: the --top best and the best
of each mode (--sweep modes) at every --rates rate (or the offered rates of a libserve JSON,
--rates-from) plus --fractions of the best configuration's peak. The JSON (--json) is shaped like
libserve's: results [{policy, offered_rps, throughput_rps, p50_ms, p90_ms, p99_ms, mean_batch, ...}]
and peaks [{policy, peak_rps, window}], plus the screen and the choice.

Noise: near half load a bucketing server's queue swings between small, inefficient batches and
large ones, so a 2 s run's p90 can vary 3x between identical repeats; pass a larger --duration-s
(8 s and more) when percentiles matter more than time. The collector is frozen after start-up
(gc.freeze, as long-running Python servers do): otherwise one full collection stalls ~100 ms.

Example:
  python torch_lstm_server.py --rates-from serve_bench.json --lengths lens.json --json out.json
  python torch_lstm_server.py --model treelstm --model-dir m --requests trees.json --vocab 30000 --json out.json
"""

import argparse
import collections
import gc
import json
import math
import os
import sys
import threading
import time

try:
    import numpy as np
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
except ImportError as e:  # --help needs neither
    if not {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(f"{e}: the peer needs a python with torch and numpy")

# Batching modes of each --model, and the default grid.
MODES = {"lstm": ("bucket", "pack", "pad"), "seq2seq": ("pack", "bucket"), "treelstm": ("fifo", "bucket")}
DEFAULT_MODES = {"lstm": "bucket,pack,pad", "seq2seq": "bucket,pack", "treelstm": "fifo,bucket"}

# Constants of libserve's src/workload.rs (WMT-like lengths) and bench_rnn.rs.
WMT_MEAN_LEN = 24.0
WMT_SIGMA = 0.7276
WMT_MIN_LEN, WMT_MAX_LEN = 1, 330
DISTINCT_REQUESTS = 4096
SETTLE_FRACTION = 0.2

clock = time.perf_counter


# ------------------------------------------------------------------------------------------------
# Model and requests
# ------------------------------------------------------------------------------------------------


class LstmModel:
    """Embedding + 1-layer LSTM; `run(mode, seqs, lens)` gives each sequence's final h."""

    def __init__(self, vocab, embed, hidden, layers, seed):
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, embed).eval()
        self.lstm = torch.nn.LSTM(embed, hidden, num_layers=layers, batch_first=True).eval()

    def run(self, mode, seqs, lens):
        """seqs: list of 1-D int64 token tensors; lens: int64 tensor of their lengths."""
        x = self.emb(pad_sequence(seqs, batch_first=True))
        if mode == "pack":
            packed = pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=False)
            _, (h, _) = self.lstm(packed)  # h_n is in the input order
            return h[-1]
        out, (h, _) = self.lstm(x)
        if int(lens.min()) == x.shape[1]:  # no padding in this batch
            return h[-1]
        return out[torch.arange(len(seqs)), lens - 1]

    def run_batch(self, mode, reqs, idxs):
        """The final h of requests idxs, as a numpy array (the per-request results are its rows)."""
        seqs = [reqs.get(i)[0] for i in idxs]
        lens = torch.tensor([reqs.get(i)[1] for i in idxs], dtype=torch.int64)
        return self.run(mode, seqs, lens).numpy()


def wmt_lengths(n, seed):
    """Same distribution as libserve's workload::wmt_lengths (not the same draws)."""
    mu = math.log(WMT_MEAN_LEN) - WMT_SIGMA * WMT_SIGMA / 2.0
    x = np.random.default_rng(seed).lognormal(mu, WMT_SIGMA, n)
    return np.clip(np.rint(x), WMT_MIN_LEN, WMT_MAX_LEN).astype(int).tolist()


class Requests:
    """The distinct requests; request i of every run is requests[i % n]."""

    def __init__(self, lengths, vocab, seed):
        rng = np.random.default_rng(seed ^ 0x7E571A9E)
        self.lengths = [int(n) for n in lengths]
        self.tokens = [torch.from_numpy(rng.integers(0, vocab, n, dtype=np.int64)) for n in self.lengths]

    def __len__(self):
        return len(self.lengths)

    def get(self, i):
        k = i % len(self.lengths)
        return self.tokens[k], self.lengths[k]


# ------------------------------------------------------------------------------------------------
# Dynamic batchers. A queued request is (index, arrival time, length).
# ------------------------------------------------------------------------------------------------


class FifoBatcher:
    """TorchServe/Triton dynamic batching: oldest first; a batch runs when it is full or its oldest
    request has waited max_delay."""

    def __init__(self, max_batch, max_delay):
        self.b, self.d = max_batch, max_delay
        self.q = collections.deque()

    def add(self, req):
        self.q.append(req)

    def __len__(self):
        return len(self.q)

    def take(self, now):
        q = self.q
        if not q or (len(q) < self.b and now - q[0][1] < self.d):
            return None
        return [q.popleft() for _ in range(min(self.b, len(q)))]

    def next_deadline(self):
        return self.q[0][1] + self.d if self.q else math.inf

    def drain(self):
        left, self.q = list(self.q), collections.deque()
        return left


class BucketBatcher:
    """Length buckets of `width` tokens; a bucket is ready when it holds max_batch requests or its
    oldest has waited max_delay; the ready bucket with the oldest head gives the next batch."""

    def __init__(self, max_batch, max_delay, width):
        self.b, self.d, self.w = max_batch, max_delay, width
        self.buckets = collections.defaultdict(collections.deque)
        self.n = 0

    def add(self, req):
        self.buckets[(req[2] - 1) // self.w].append(req)
        self.n += 1

    def __len__(self):
        return self.n

    def take(self, now):
        best, best_t = None, math.inf
        for q in self.buckets.values():
            if q and (len(q) >= self.b or now - q[0][1] >= self.d) and q[0][1] < best_t:
                best, best_t = q, q[0][1]
        if best is None:
            return None
        batch = [best.popleft() for _ in range(min(self.b, len(best)))]
        self.n -= len(batch)
        return batch

    def next_deadline(self):
        return min((q[0][1] + self.d for q in self.buckets.values() if q), default=math.inf)

    def drain(self):
        left = [r for q in self.buckets.values() for r in q]
        self.buckets.clear()
        self.n = 0
        return left


class Config:
    def __init__(self, mode, max_batch, max_delay_ms, bucket_width):
        self.mode, self.b, self.d_ms, self.width = mode, max_batch, max_delay_ms, bucket_width

    @property
    def label(self):
        extra = f",w={self.width}" if self.mode == "bucket" else ""
        return f"torch-{self.mode}(b={self.b},d={self.d_ms:g}ms{extra})"

    def batcher(self):
        d = self.d_ms / 1e3
        if self.mode == "bucket":
            return BucketBatcher(self.b, d, self.width)
        return FifoBatcher(self.b, d)


# ------------------------------------------------------------------------------------------------
# Arrival sources: what the serving loop admits, and how it waits for more.
# ------------------------------------------------------------------------------------------------


class InlineArrivals:
    """Open loop: request i arrives at start + offsets[i]; the serving loop admits it itself."""

    def __init__(self, offsets, start):
        self.due = (start + offsets).tolist()
        self.i = 0

    def start(self):
        pass

    def poll(self, now, out):
        i, due = self.i, self.due
        while i < len(due) and due[i] <= now:
            out.append((i, due[i]))
            i += 1
        self.i = i

    def next_time(self):
        return self.due[self.i] if self.i < len(self.due) else math.inf

    def finished(self):
        return self.i >= len(self.due)

    def wait(self, until):
        dt = until - clock()
        if dt > 0:
            time.sleep(dt)

    def completed(self, batch, t):
        pass

    def stop(self):
        pass


class ThreadArrivals(InlineArrivals):
    """Open loop: a Python client thread submits request i at start + offsets[i] into a locked
    queue; the serving loop waits on it."""

    def __init__(self, offsets, start):
        super().__init__(offsets, start)
        self.cv = threading.Condition()
        self.inbox = []
        self.sent = False
        self.thread = threading.Thread(target=self._send, daemon=True)

    def start(self):
        self.thread.start()

    def _send(self):
        for i, due in enumerate(self.due):
            dt = due - clock()
            if dt > 0:
                time.sleep(dt)
            with self.cv:
                self.inbox.append((i, due))
                self.cv.notify()
        with self.cv:
            self.sent = True
            self.cv.notify()

    def poll(self, now, out):
        with self.cv:
            if self.inbox:
                out.extend(self.inbox)
                self.inbox = []

    def next_time(self):
        return math.inf

    def finished(self):
        with self.cv:
            return self.sent and not self.inbox

    def wait(self, until):
        with self.cv:
            if not self.inbox and not self.sent:
                self.cv.wait(max(0.0, min(until - clock(), 1.0)))

    def stop(self):
        self.thread.join()


class ClosedLoop:
    """Closed loop: `window` requests in flight; each completion is replaced at once (until
    `limit` requests have been issued, if given)."""

    def __init__(self, window, limit=None):
        self.window, self.limit = window, limit
        self.next = 0
        self.pending = []

    def _issue(self, k, t):
        if self.limit is not None:
            k = min(k, self.limit - self.next)
        self.pending.extend((self.next + j, t) for j in range(k))
        self.next += k

    def start(self):
        self._issue(self.window, clock())

    def poll(self, now, out):
        out.extend(self.pending)
        self.pending = []

    def next_time(self):
        return math.inf

    def finished(self):
        return self.limit is not None and self.next >= self.limit and not self.pending

    def wait(self, until):
        dt = until - clock()
        if dt > 0:
            time.sleep(dt)

    def completed(self, batch, t):
        self._issue(len(batch), t)

    def stop(self):
        pass


# ------------------------------------------------------------------------------------------------
# The serving loop and the measurements
# ------------------------------------------------------------------------------------------------


def serve(model, reqs, cfg, source, stop_at, on_batch):
    """Admit, batch, run until the source is finished and the queue empty, or until stop_at.
    on_batch(batch, done_time) sees every completed batch. Returns the requests left unserved."""
    batcher = cfg.batcher()
    arrived = []
    source.start()
    while True:
        now = clock()
        source.poll(now, arrived)
        for idx, t in arrived:
            batcher.add((idx, t, reqs.get(idx)[1]))
        arrived.clear()
        if now >= stop_at:
            break
        batch = batcher.take(now)
        if batch is not None:
            out = model.run_batch(cfg.mode, reqs, [i for i, _, _ in batch])
            done = clock()
            del out
            on_batch(batch, done)
            source.completed(batch, done)
            continue
        if source.finished() and len(batcher) == 0:
            break
        source.wait(min(source.next_time(), batcher.next_deadline(), stop_at))
    source.stop()
    return batcher.drain()


def warm_up(model, reqs, cfg, n):
    """A short closed loop of n requests (not measured)."""
    serve(model, reqs, cfg, ClosedLoop(min(n, cfg.b), limit=n), clock() + 60.0, lambda batch, t: None)


def measure_peak(model, reqs, cfg, window, seconds):
    """libserve's measure_capacity: closed loop, count after 20% settling, first..last counted."""
    warm_up(model, reqs, cfg, max(32, 2 * cfg.b))
    start = clock()
    settle, end = start + SETTLE_FRACTION * seconds, start + seconds
    st = {"from": None, "last": None, "counted": 0, "rows": 0, "batches": 0}

    def on_batch(batch, t):
        if t > end:
            return
        st["rows"] += len(batch)
        st["batches"] += 1
        if t >= settle:
            if st["from"] is None:
                st["from"] = t
            elif t > st["from"]:
                st["counted"] += len(batch)
                st["last"] = t

    serve(model, reqs, cfg, ClosedLoop(window), end, on_batch)
    span = (st["last"] - st["from"]) if st["last"] else 0.0
    peak = st["counted"] / span if span > 0 else 0.0
    return {"policy": cfg.label, "peak_rps": peak, "window": window,
            "mean_batch": st["rows"] / max(1, st["batches"])}


def run_open_loop(model, reqs, cfg, rate, n, seed, arrivals):
    """libserve's run_open_loop: n Poisson arrivals at `rate`, latency from the scheduled arrival."""
    warm_up(model, reqs, cfg, max(32, 2 * cfg.b))
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    offsets = np.cumsum(gaps)
    span = float(offsets[-1])
    start = clock() + 0.002
    source = (ThreadArrivals if arrivals == "thread" else InlineArrivals)(offsets, start)
    lat = np.empty(n)
    st = {"ok": 0, "batches": 0, "last": start}

    def on_batch(batch, t):
        for i, due, _ in batch:
            lat[st["ok"]] = t - due
            st["ok"] += 1
        st["batches"] += 1
        st["last"] = t

    left = serve(model, reqs, cfg, source, start + span + max(span, 1.0), on_batch)
    ok = st["ok"]
    unsent = n - ok - len(left)  # arrivals never admitted (the stop came first)
    elapsed = st["last"] - start
    q = (np.quantile(lat[:ok], [0.5, 0.9, 0.99], method="inverted_cdf") * 1e3) if ok else [math.nan] * 3
    return {
        "policy": cfg.label + (",client-thread" if arrivals == "thread" else ""),
        "offered_rps": rate,
        "throughput_rps": ok / elapsed if elapsed > 0 else 0.0,
        "p50_ms": float(q[0]), "p90_ms": float(q[1]), "p99_ms": float(q[2]),
        "mean_batch": ok / max(1, st["batches"]),
        "completed": ok,
        "errors": n - ok,
        "error_codes": {"CANCELLED": n - ok} if n > ok else {},
        "unsent": unsent,
        "arrivals": arrivals,
    }


def self_check(model, reqs, modes):
    """Every mode gives each request the h of its own sequence run alone."""
    idxs = list(range(12))
    seqs = [reqs.get(i)[0] for i in idxs]
    lens = torch.tensor([reqs.get(i)[1] for i in idxs])
    ref = torch.stack([model.run("pad", [s], torch.tensor([len(s)]))[0] for s in seqs])
    for mode in modes:
        got = model.run(mode, seqs, lens)
        err = float((got - ref).abs().max())
        if err > 1e-4:
            sys.exit(f"self-check failed: mode {mode} differs from unbatched runs by {err}")


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def finite(v):
    """`v` with every non-finite float (the NaN percentiles of a run that completed nothing) as None:
    strict JSON, which `serve bench lstm` reads."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


def floats(s):
    return [float(x) for x in s.split(",") if x.strip()]


def ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args():
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODES), default="lstm",
                   help="lstm: random weights (seeded); seq2seq, treelstm: --model-dir and --requests")
    p.add_argument("--modes", help="comma-separated; lstm: pack, pad, bucket (default all); seq2seq: "
                                   "pack, bucket (default both); treelstm: fifo, bucket (default both)")
    p.add_argument("--max-batch", type=ints, default=[16, 64, 256], help="grid of max batch sizes")
    p.add_argument("--max-delay-ms", type=floats, default=[0.0, 2.0, 10.0], help="grid of max queue delays")
    p.add_argument("--bucket-width", type=int, default=10)
    p.add_argument("--rates", type=floats, default=[], help="offered rates, rps (comma-separated)")
    p.add_argument("--rates-from", help="libserve `serve bench lstm --json` report: use its offered rates")
    p.add_argument("--fractions", type=floats, default=[0.25, 0.5, 0.75, 0.9],
                   help="also offer these fractions of the best PyTorch peak")
    p.add_argument("--sweep", choices=["best", "modes", "all"], default="modes",
                   help="configurations swept over the rates: the --top best, plus the best of each mode "
                        "(modes), or all")
    p.add_argument("--top", type=int, default=2, help="how many of the best configurations to sweep")
    p.add_argument("--no-screen", action="store_true",
                   help="skip the screen; choose by peak only (e.g. for a single configuration)")
    p.add_argument("--screen-s", type=float, default=6.0,
                   help="seconds of arrivals per screened configuration (latency near half load is slow "
                        "to settle: a 2 s run's p90 can vary 3x between repeats)")
    p.add_argument("--peak-tolerance", type=float, default=0.10,
                   help="configurations within this fraction of the best peak compete on screened p90 "
                        "(peaks vary ~5-10%% between runs on a shared VM)")
    p.add_argument("--arrivals", choices=["inline", "thread"], default="inline")
    p.add_argument("--min-requests", type=int, default=2000, help="fewest requests per offered rate")
    p.add_argument("--duration-s", type=float, default=2.0, help="else rate x this many seconds")
    p.add_argument("--capacity-s", type=float, default=3.0, help="closed-loop seconds per peak")
    p.add_argument("--window", type=int, default=2048,
                   help="closed-loop requests in flight (libserve: 4 x cellular's max batch 512)")
    p.add_argument("--lengths", help="lstm: JSON list of request lengths (e.g. libserve's exact ones)")
    p.add_argument("--model-dir", help="seq2seq, treelstm: libserve's model directory (weights.safetensors)")
    p.add_argument("--requests", help="seq2seq, treelstm: JSON file of the bench's requests "
                                      "({\"sources\": [...]} or {\"trees\": [...]})")
    p.add_argument("--bos", type=int, default=1, help="seq2seq: the first token fed to the decoder")
    p.add_argument("--eos", type=int, default=2, help="seq2seq: the token that ends a decode")
    p.add_argument("--max-decode", type=int, default=20, help="seq2seq: most output tokens")
    p.add_argument("--decoder-step", choices=["cell", "lstm"], default="cell",
                   help="seq2seq: a decoder step as one nn.LSTMCell per layer, or one nn.LSTM call")
    p.add_argument("--outputs", help="seq2seq, treelstm: write the outputs of the first --check-requests "
                                     "distinct requests here (JSON) for the bench to compare")
    p.add_argument("--check-requests", type=int, default=1024)
    p.add_argument("--check-only", action="store_true",
                   help="seq2seq, treelstm: write --outputs and stop (no serving)")
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the report here")
    return p.parse_args()


def rank(rows, peaks, screen, tol):
    """Best first: the rows within tol of the rows' best peak by screened p90, then the rest (and
    everything, when nothing was screened) by peak."""
    top = max(peaks[c.label]["peak_rps"] for c in rows)
    ok = lambda c: c.label in screen and screen[c.label]["errors"] == 0  # noqa: E731
    near = [c for c in rows if peaks[c.label]["peak_rps"] >= (1 - tol) * top and ok(c)]
    near.sort(key=lambda c: screen[c.label]["p90_ms"])
    rest = sorted((c for c in rows if c not in near), key=lambda c: -peaks[c.label]["peak_rps"])
    return near + rest


def load_lstm(a, say):
    """--model lstm: random weights and requests of the given (or sampled) lengths."""
    if a.model_dir or a.requests or a.outputs or a.check_only:
        sys.exit("--model-dir, --requests, --outputs and --check-only are for --model seq2seq|treelstm")
    if a.lengths:
        with open(a.lengths) as f:
            lengths, lengths_src = json.load(f), a.lengths
    else:
        lengths, lengths_src = wmt_lengths(DISTINCT_REQUESTS, a.seed), "numpy lognormal(seed)"
    model = LstmModel(a.vocab, a.embed, a.hidden, a.layers, a.seed)
    reqs = Requests(lengths, a.vocab, a.seed)
    mean_len = sum(lengths) / len(lengths)
    say(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; model vocab {a.vocab} embed "
        f"{a.embed} hidden {a.hidden} layers {a.layers}; {len(lengths)} distinct requests, mean length "
        f"{mean_len:.2f} ({lengths_src}); arrivals {a.arrivals}")
    model_json = {"kind": "lstm", "vocab": a.vocab, "embed": a.embed, "hidden": a.hidden,
                  "layers": a.layers, "source": f"random(seed={a.seed})"}
    return model, reqs, model_json, {"distinct": len(lengths), "mean_cells": mean_len, "lengths": lengths_src}


def load_rnn(a, say):
    """--model seq2seq|treelstm: the bench's weights (--model-dir) and requests (--requests)."""
    if not (a.model_dir and a.requests):
        sys.exit(f"--model {a.model} needs --model-dir and --requests (the bench passes both)")
    if a.lengths:
        sys.exit("--lengths is for --model lstm (seq2seq and treelstm read --requests)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch_rnn_models  # noqa: E402 (beside this file; the bench writes both)

    try:
        model, reqs = torch_rnn_models.load(a)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        sys.exit(f"cannot load the {a.model} model from {a.model_dir} or the requests {a.requests}: {e}")
    desc, mean = reqs.describe()
    model_json = {"kind": a.model, "vocab": a.vocab, "embed": a.embed, "hidden": a.hidden,
                  "source": a.model_dir}
    extra = ""
    if a.model == "seq2seq":
        model_json.update(layers=a.layers, bos=a.bos, eos=a.eos, max_decode=a.max_decode)
        model_json["decoder_step"] = a.decoder_step
        extra = f" layers {a.layers} bos {a.bos} eos {a.eos} max_decode {a.max_decode}; decoder step {a.decoder_step}"
    say(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; model {a.model} vocab {a.vocab} "
        f"embed {a.embed} hidden {a.hidden}{extra} (weights of {a.model_dir}); {len(reqs)} distinct "
        f"requests, {desc} ({a.requests}); arrivals {a.arrivals}")
    return model, reqs, model_json, {"distinct": len(reqs), "mean_cells": mean, "source": a.requests}


def main():
    a = parse_args()
    t0 = clock()
    torch.set_num_threads(a.threads)
    modes = [m.strip() for m in (a.modes or DEFAULT_MODES[a.model]).split(",") if m.strip()]
    for m in modes:
        if m not in MODES[a.model]:
            sys.exit(f"unknown mode {m!r} for --model {a.model} (modes: {', '.join(MODES[a.model])})")
    rates = list(a.rates)
    if a.rates_from:
        with open(a.rates_from) as f:
            rates += [r["offered_rps"] for r in json.load(f)["results"]]
    say = lambda s: print(s, flush=True)  # noqa: E731
    model, reqs, model_json, requests_json = (load_lstm if a.model == "lstm" else load_rnn)(a, say)
    # As long-running Python servers do: move the start-up objects (model, requests, torch's own)
    # out of the collector's reach, so a full collection does not stall serving for ~100 ms.
    gc.collect()
    gc.freeze()
    check = None
    with torch.inference_mode():
        if a.model == "lstm":
            self_check(model, reqs, modes)
        else:
            import torch_rnn_models

            failed = torch_rnn_models.self_check(model, reqs, modes, a.model)
            if failed:
                sys.exit(f"self-check failed: {failed}")
            check = torch_rnn_models.write_outputs(model, reqs, modes[0], a.model, a.check_requests, a.outputs)
            mean = check.get("mean_decode_tokens")
            say(f"# check: outputs of the first {check['requests']} distinct requests ({modes[0]}, batches of 64)"
                + (f": mean decode {mean:.2f} tokens" if mean is not None else "")
                + (f"; written to {a.outputs}" if a.outputs else ""))
            if a.check_only:
                return
        grid = [Config(m, b, d, a.bucket_width) for m in modes for b in a.max_batch for d in a.max_delay_ms]

        peaks = {}
        for c in grid:
            peaks[c.label] = measure_peak(model, reqs, c, a.window, a.capacity_s)
            say(f"# peak {c.label:<34} {peaks[c.label]['peak_rps']:9.1f} rps "
                f"(closed loop, {a.window} in flight, mean batch {peaks[c.label]['mean_batch']:.1f})")
        best_peak = max(p["peak_rps"] for p in peaks.values())
        if best_peak <= 0:
            sys.exit(f"no configuration completed requests in its closed loop of {a.capacity_s} s "
                     f"(--capacity-s): no peak to offer fractions of")

        screen = {}
        screen_rate = round(0.5 * best_peak)
        if not a.no_screen:
            n = max(a.min_requests, math.ceil(screen_rate * a.screen_s))
            for c in grid:
                if peaks[c.label]["peak_rps"] < 1.05 * screen_rate:
                    continue  # would be overloaded
                screen[c.label] = run_open_loop(model, reqs, c, screen_rate, n, a.seed, a.arrivals)
                r = screen[c.label]
                say(f"# screen {c.label:<34} @ {screen_rate} rps: p50 {r['p50_ms']:.2f} p90 {r['p90_ms']:.2f} "
                    f"p99 {r['p99_ms']:.2f} ms, mean batch {r['mean_batch']:.1f}, errors {r['errors']}")

        ranked = rank(grid, peaks, screen, a.peak_tolerance)
        best = ranked[0]
        chosen = {c.label: c for c in ranked[:max(1, a.top)]}
        if a.sweep == "modes":
            for m in modes:
                c = rank([c for c in grid if c.mode == m], peaks, screen, a.peak_tolerance)[0]
                chosen.setdefault(c.label, c)
        elif a.sweep == "all":
            chosen = {c.label: c for c in grid}
        ref_peak = peaks[best.label]["peak_rps"]
        rule = (f"lowest p90 at {screen_rate} rps among peaks within {a.peak_tolerance:.0%} of the best "
                f"{best_peak:.1f}" if screen else "highest peak")
        say(f"# best: {best.label} (peak {ref_peak:.1f} rps; rule: {rule}); swept: {', '.join(chosen)}")

        all_rates = sorted(set([round(r, 1) for r in rates] + [float(round(f * ref_peak)) for f in a.fractions]))
        if any(r <= 0 for r in all_rates):
            say(f"# not offered (below 1 rps): {', '.join(f'{r:g}' for r in all_rates if r <= 0)}")
            all_rates = [r for r in all_rates if r > 0]
        say(f"# offered rates (rps): {', '.join(f'{r:g}' for r in all_rates)}")
        say(f"{'policy':<40} {'offered':>9} {'thrpt':>9} {'p50_ms':>9} {'p90_ms':>9} {'p99_ms':>9} "
            f"{'batch':>7} {'errors':>7}")
        results = []
        for k, rate in enumerate(all_rates):
            n = max(a.min_requests, math.ceil(rate * a.duration_s))
            for c in chosen.values():
                r = run_open_loop(model, reqs, c, rate, n, a.seed + 1 + k, a.arrivals)
                r["peak_rps"] = peaks[c.label]["peak_rps"]
                r["fraction_of_peak"] = rate / r["peak_rps"] if r["peak_rps"] > 0 else None
                r["fraction_of_best_peak"] = rate / ref_peak
                results.append(r)
                say(f"{r['policy']:<40} {rate:9.1f} {r['throughput_rps']:9.1f} {r['p50_ms']:9.2f} "
                    f"{r['p90_ms']:9.2f} {r['p99_ms']:9.2f} {r['mean_batch']:7.1f} {r['errors']:7d}")
    say(f"# done in {clock() - t0:.1f} s")
    if a.json:
        report = {
            "tool": "torch_lstm_server.py",
            "workload": "poisson/treebank" if a.model == "treelstm" else "poisson/wmt",
            "backend": "torch-cpu",
            "backend_description": f"PyTorch {torch.__version__} eager, {torch.get_num_threads()} threads",
            "model": model_json,
            "requests": requests_json,
            "arrivals": a.arrivals,
            "grid": {"modes": modes, "max_batch": a.max_batch, "max_delay_ms": a.max_delay_ms,
                     "bucket_width": a.bucket_width},
            "peaks": list(peaks.values()),
            "best": {"policy": best.label, "peak_rps": ref_peak, "best_peak_rps": best_peak,
                     "rule": rule, "screen_rps": screen_rate if screen else None,
                     "peak_tolerance": a.peak_tolerance},
            "swept": list(chosen),
            "screen": list(screen.values()),
            "results": results,
        }
        if check is not None:
            report["check"] = check
        with open(a.json, "w") as f:
            json.dump(finite(report), f, indent=2, allow_nan=False)
            f.write("\n")
        say(f"# wrote {a.json}")


if __name__ == "__main__":
    main()
