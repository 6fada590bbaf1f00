//! Every hand-written CUDA kernel (`cuda/*.cu`) against the CPU backend on the same inputs
//! (ARCHITECTURE.md §9, issue 4 item 7), here the input and output kernels' (the recurrent
//! cells are in `tests/cuda_kernels.rs`; the shared harness is `tests/common/cuda_kernels.rs`):
//!
//! * `serve_embedding_gather` from pinned mapped (zero-copy) and device tables against
//!   `embed_rows`: out-of-range ids give a zero row and the row's error flag and are never read
//!   (guard rows with a sentinel after the table; tables ending exactly at the end of their
//!   allocation; ids up to 2³² − 3), `SERVE_NO_TOKEN` rows are zero, padding columns untouched.
//! * `serve_bias_act` (after a cuBLAS GEMM) against the CPU's `linear`: bias or none, ReLU or
//!   none, out of place (padding columns untouched), in place, into pinned mapped host memory,
//!   NaN through ReLU.
//! * Completion signals: 4 streams × 1000 tasks in flight, each a small kernel writing its task id
//!   into mapped host memory and then the signal kernel; a poller thread sees every counter
//!   monotonic and, for each value it reads, the outputs of the tasks counted already visible
//!   (acquire semantics).
//!
//! Each check runs on two targets (`tests/common/cuda_kernels.rs`): on device 0, and as
//! `*_on_host` on the same kernel sources compiled for the CPU (`cuda/host/`), so that every
//! kernel's arithmetic and indexing is checked against the CPU backend on any machine (the GEMMs
//! between kernels are cuBLAS on the GPU, `matrixmultiply` on the host). With no CUDA device
//! each GPU test prints `skipped: no CUDA device` and passes, unless `SERVE_REQUIRE_GPU=1`,
//! which makes a missing device (or a missing NVRTC / cuBLAS the test needs) a failure.

mod common;

use std::time::{Duration, Instant};

use common::cuda_kernels::{Arena, Buf, Dev, SlotTokens, assert_close, gpu, host, mix, relu_act, u32_of};

use serve::backend::cpu::arena::StateArena;
use serve::backend::cpu::gemm::{PackedWeight, Threads, linear};
use serve::backend::cpu::lstm_cell::embed_rows;
use serve::backend::cuda::abi::{self, EmbeddingParams, SignalParams};
use serve::backend::cuda::kernels::{self, BLOCK};
use serve::backend::cuda::{LaunchConfig, PinnedMapped, Stream};
use serve::model::NO_TOKEN;
use serve::workload::values;

// ---------------------------------------------------------------------------------------------
// Embedding gather.

/// Sentinel stored in guard rows after a table and in output columns the kernel must not write.
const GUARD: f32 = 7777.0;
const UNWRITTEN: f32 = -5555.0;

/// The gather of `ids` from `table` (`rows × width` valid rows), against `embed_rows`.
fn check_embedding(
    g: &Dev,
    table: &Buf<f32>,
    host: &[f32],
    rows: usize,
    width: usize,
    ids: &[u32],
    what: &str,
) {
    let batch = ids.len();
    // The vectorised path needs out_ld % 4 == 0; the scalar one is exercised by odd widths.
    let out_ld = if width.is_multiple_of(4) { width + 4 } else { width + 3 };
    let out = g.upload(&vec![UNWRITTEN; batch * out_ld]).unwrap();
    let errors = g.upload(&vec![0xDEAD_BEEFu32; batch]).unwrap();
    let ids_d = g.upload(ids).unwrap();
    g.embed(table, rows, width, &ids_d, None, &out, out_ld, Some(&errors));
    let bad = |id: u32| id != NO_TOKEN && id as usize >= rows;
    let ref_ids: Vec<u32> = ids.iter().map(|&id| if bad(id) { NO_TOKEN } else { id }).collect();
    let mut want = vec![0.0; batch * width];
    embed_rows(&host[..rows * width], width, &ref_ids, &mut want);
    let got = g.download(&out).unwrap();
    for r in 0..batch {
        let row = &got[r * out_ld..(r + 1) * out_ld];
        assert_eq!(&row[..width], &want[r * width..(r + 1) * width], "{what}: row {r} (id {:#x})", ids[r]);
        assert!(row[width..].iter().all(|&v| v == UNWRITTEN), "{what}: row {r} beyond the width written");
    }
    let flags: Vec<u32> =
        ids.iter().map(|&id| if bad(id) { abi::SERVE_ROW_BAD_TOKEN } else { abi::SERVE_ROW_OK }).collect();
    assert_eq!(g.download(&errors).unwrap(), flags, "{what}: error words");

    // Without an error buffer (errors = 0): the same rows.
    let out2 = g.upload(&vec![UNWRITTEN; batch * out_ld]).unwrap();
    g.embed(table, rows, width, &ids_d, None, &out2, out_ld, None);
    assert_eq!(g.download(&out2).unwrap(), got, "{what}: without error words");
}

/// `n` ids over a table of `rows` rows followed by `guard` guard rows: valid ones (first, last,
/// repeats), no-token rows, and ids just past the end, at the guard rows, and far beyond (which
/// would fault if read); the special ones first.
fn embedding_ids(rows: usize, guard: usize, n: usize) -> Vec<u32> {
    let r = rows as u32;
    let mut ids = match n {
        1 => vec![r],
        3 => vec![r - 1, NO_TOKEN, NO_TOKEN - 2],
        _ => vec![0, r - 1, NO_TOKEN, r, r + 1, 5, 5, 0x7FFF_FFFF, abi::SERVE_TOKEN_FROM_SLOT, NO_TOKEN - 2],
    };
    if n > 3 {
        ids.extend((0..guard as u32).map(|k| r + k));
    }
    let mut i = 0u64;
    while ids.len() < n {
        ids.push(match i % 9 {
            0 => NO_TOKEN,
            1 => r + (mix(i, 5) % 1000) as u32,
            _ => (mix(i, 6) % rows as u64) as u32,
        });
        i += 1;
    }
    ids.truncate(n);
    ids
}

on_gpu_and_host!(check_embedding_tables(false): embedding_gather_from_pinned_and_device_tables_checks_every_id, embedding_gather_from_pinned_and_device_tables_checks_every_id_on_host);

fn check_embedding_tables(g: Dev) {
    // (rows, width): 1024 × 64 floats = 256 KiB and 512 × 30 floats = 60 KiB are whole pages, so
    // the exact-size tables below end at the last byte of their allocation.
    for (rows, width) in [(1024usize, 64usize), (512, 30)] {
        assert_eq!(rows * width * 4 % 4096, 0);
        let guard = 8;
        let host = values(rows * width, rows as u64, 1.0);
        let mut guarded = host.clone();
        guarded.resize((rows + guard) * width, GUARD);
        for batch in [1usize, 3, 64, 512] {
            let ids = embedding_ids(rows, guard, batch);
            // Pinned mapped (zero-copy), exactly the table: ends at the end of the allocation.
            let mut pinned = g.pinned::<f32>(rows * width).unwrap();
            pinned.write(0, &host).unwrap();
            check_embedding(
                &g,
                &pinned,
                &host,
                rows,
                width,
                &ids,
                &format!("pinned {rows}x{width}, {batch} ids"),
            );
            // Pinned with guard rows after the table: an id the kernel read anyway would show 7777.
            let mut pinned_guard = g.pinned::<f32>(guarded.len()).unwrap();
            pinned_guard.write(0, &guarded).unwrap();
            check_embedding(
                &g,
                &pinned_guard,
                &guarded,
                rows,
                width,
                &ids,
                &format!("pinned+guard {rows}x{width}"),
            );
            // Device tables, exactly sized and with guard rows.
            let dev_exact = g.upload(&host).unwrap();
            check_embedding(
                &g,
                &dev_exact,
                &host,
                rows,
                width,
                &ids,
                &format!("device {rows}x{width}, {batch} ids"),
            );
            let dev_guard = g.upload(&guarded).unwrap();
            check_embedding(
                &g,
                &dev_guard,
                &guarded,
                rows,
                width,
                &ids,
                &format!("device+guard {rows}x{width}"),
            );
        }
    }
    // A stray read far outside a table would have raised an illegal-address error by now.
    g.synchronize().unwrap();
}

on_gpu_and_host!(check_embedding_from_slots(false): embedding_tokens_from_slots_are_checked_too, embedding_tokens_from_slots_are_checked_too_on_host);

fn check_embedding_from_slots(g: Dev) {
    let (rows, width) = (100usize, 8usize);
    let host = values(rows * width, 3, 1.0);
    let table = g.upload(&host).unwrap();
    // Arena of 4 slots × 3 words; the token lives at word 2.
    let cpu_arena = StateArena::new(4, 3).unwrap();
    for (s, tok) in [(0u32, 7u32), (1, 99), (2, 100), (3, 0xFFFF_FFF0)] {
        cpu_arena.write(s, 0, &[1.5, -2.5]);
        cpu_arena.write_u32(s, 2, tok);
    }
    let arena = Arena::upload(&g, &cpu_arena);
    // Row: (id, slot word) → expected token or bad.
    let cases: [(u32, u32, Option<u32>); 8] = [
        (abi::SERVE_TOKEN_FROM_SLOT, 0, Some(7)),
        (abi::SERVE_TOKEN_FROM_SLOT, 1 | abi::SERVE_ROW_FRESH, Some(99)), // flag bit ignored
        (abi::SERVE_TOKEN_FROM_SLOT, 2, None),                            // token 100 = rows: bad
        (abi::SERVE_TOKEN_FROM_SLOT, 3, None),                            // huge token: bad
        (abi::SERVE_TOKEN_FROM_SLOT, 4, None),                            // slot out of range: bad
        (abi::SERVE_TOKEN_FROM_SLOT, 0x7FFF_FFFF, None),
        (42, 3, Some(42)), // a plain id ignores the slot
        (NO_TOKEN, 3, Some(NO_TOKEN)),
    ];
    let ids_d = g.upload(&cases.map(|c| c.0)).unwrap();
    let slots_d = g.upload(&cases.map(|c| c.1)).unwrap();
    let out = g.upload(&vec![UNWRITTEN; cases.len() * width]).unwrap();
    let errors = g.alloc::<u32>(cases.len()).unwrap();
    let from = SlotTokens { slots: &slots_d, arena: &arena, token_offset: 2 };
    g.embed(&table, rows, width, &ids_d, Some(&from), &out, width, Some(&errors));
    let ref_ids: Vec<u32> = cases.iter().map(|c| c.2.unwrap_or(NO_TOKEN)).collect();
    let mut want = vec![0.0; cases.len() * width];
    embed_rows(&host, width, &ref_ids, &mut want);
    assert_eq!(g.download(&out).unwrap(), want);
    let flags: Vec<u32> = cases
        .iter()
        .map(|c| if c.2.is_some() { abi::SERVE_ROW_OK } else { abi::SERVE_ROW_BAD_TOKEN })
        .collect();
    assert_eq!(g.download(&errors).unwrap(), flags);

    // A token offset outside the slot, or no slot words at all: every FROM_SLOT row is bad.
    for from in [Some(SlotTokens { slots: &slots_d, arena: &arena, token_offset: 3 }), None] {
        let out = g.upload(&vec![UNWRITTEN; cases.len() * width]).unwrap();
        g.embed(&table, rows, width, &ids_d, from.as_ref(), &out, width, Some(&errors));
        let flags: Vec<u32> =
            cases
                .iter()
                .map(|c| {
                    if c.0 == abi::SERVE_TOKEN_FROM_SLOT {
                        abi::SERVE_ROW_BAD_TOKEN
                    } else {
                        abi::SERVE_ROW_OK
                    }
                })
                .collect();
        assert_eq!(g.download(&errors).unwrap(), flags);
        let got = g.download(&out).unwrap();
        assert!(got[..6 * width].iter().all(|&v| v == 0.0));
        assert_eq!(&got[6 * width..7 * width], &host[42 * width..43 * width]);
    }
}

// ---------------------------------------------------------------------------------------------
// Dense layers.

on_gpu_and_host!(check_bias_act(true): bias_act_after_the_gemm_matches_linear, bias_act_after_the_gemm_matches_linear_on_host);

fn check_bias_act(mut g: Dev) {
    for (rows, k, n) in [(1usize, 16usize, 8usize), (37, 50, 70), (512, 256, 1024)] {
        let x = values(rows * k, 1 + n as u64, 1.0);
        let w = values(n * k, 2 + n as u64, 1.0 / (k as f32).sqrt());
        let b = values(n, 3 + n as u64, 0.5);
        let packed = PackedWeight::from_torch(&w, n, k);
        let (x_d, w_d, b_d) = (g.upload(&x).unwrap(), g.upload(&w).unwrap(), g.upload(&b).unwrap());
        let mut y_d = g.alloc::<f32>(rows * n).unwrap();
        g.gemm((rows, n, k), &x_d, &w_d, &mut y_d);
        for relu in [false, true] {
            let what = format!("{rows}×{k}·{n}, relu {relu}");
            let mut want = vec![0.0; rows * n];
            linear(&x, &packed, &b, &mut want, rows, relu, Threads(1));
            // Out of place, into wider rows whose extra columns stay untouched.
            let ld = n + 3;
            let out = g.upload(&vec![UNWRITTEN; rows * ld]).unwrap();
            g.bias_act((&y_d, n), Some(&b_d), (&out, ld), (rows, n), relu_act(relu));
            let got = g.download(&out).unwrap();
            let dense: Vec<f32> = got.chunks_exact(ld).flat_map(|r| r[..n].to_vec()).collect();
            assert_close(&dense, &want, &format!("{what}: out of place"));
            assert!(got.chunks_exact(ld).all(|r| r[n..].iter().all(|&v| v == UNWRITTEN)), "{what}: padding");
            // Into pinned mapped host memory (a zero-copy result).
            let host = g.pinned::<f32>(rows * n).unwrap();
            g.bias_act((&y_d, n), Some(&b_d), (&host, n), (rows, n), relu_act(relu));
            assert_close(&host.to_vec(), &want, &format!("{what}: into pinned memory"));
            // In place, on a copy of the GEMM's output.
            let mut inplace = g.alloc::<f32>(rows * n).unwrap();
            g.copy(&y_d, 0, &mut inplace, 0, rows * n);
            g.bias_act((&inplace, n), Some(&b_d), (&inplace, n), (rows, n), relu_act(relu));
            assert_close(&g.download(&inplace).unwrap(), &want, &format!("{what}: in place"));
        }
        // No bias, no activation: a copy.
        let out = g.alloc::<f32>(rows * n).unwrap();
        g.bias_act((&y_d, n), None, (&out, n), (rows, n), abi::SERVE_ACT_NONE);
        assert_eq!(g.download(&out).unwrap(), g.download(&y_d).unwrap());
    }
    // NaN and infinities through the activation, as f32::max(v, 0.0) on the CPU.
    let src = [f32::NAN, -1.0, 2.0, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.5, f32::NAN];
    let src_d = g.upload(&src).unwrap();
    let bias = g.upload(&[0.0f32, 0.5, -1.0, 1.0]).unwrap();
    let out = g.alloc::<f32>(8).unwrap();
    for relu in [false, true] {
        g.bias_act((&src_d, 4), Some(&bias), (&out, 4), (2, 4), relu_act(relu));
        let got = g.download(&out).unwrap();
        let bias = [0.0f32, 0.5, -1.0, 1.0];
        for (i, (&v, &gv)) in src.iter().zip(&got).enumerate() {
            let pre = v + bias[i % 4];
            let want = if relu { pre.max(0.0) } else { pre };
            assert!(gv == want || (gv.is_nan() && want.is_nan()), "relu {relu}, element {i}: {gv} vs {want}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Completion signals.

// The signal kernel's arithmetic on both targets: one increment per launch whatever the grid,
// the counter's neighbours on its line untouched (its ordering across streams is the next
// test's, GPU only).
on_gpu_and_host!(check_signal_counts(false): signal_counts_once_per_launch, signal_counts_once_per_launch_on_host);

fn check_signal_counts(g: Dev) {
    let mut counter = g.pinned::<u64>(8).unwrap(); // one 64-byte line
    counter.write(0, &[0; 8]).unwrap();
    for (launch, (grid, block)) in [(1u32, 1u32), (3, 32), (2, 256), (1, 1)].into_iter().enumerate() {
        g.signal(&counter, grid, block);
        let line = g.download(&counter).unwrap();
        assert_eq!(line[0], launch as u64 + 1, "{} launch {launch} ({grid} × {block})", g.name());
        assert!(line[1..].iter().all(|&w| w == 0), "the rest of the line: {line:?}");
    }
}

#[test]
fn signals_on_four_streams_publish_each_tasks_output_before_its_count() {
    let Some(g) = gpu(false) else { return };
    let c = g.cuda();
    let (embedding, signal) = (c.function(kernels::EMBEDDING_GATHER), c.function(kernels::SIGNAL));
    const STREAMS: usize = 4;
    const TASKS: usize = 1000;
    const W: usize = 256; // floats each task writes into mapped host memory
    // Task t of stream s gathers table row s·TASKS + t, whose every value is that number + 1, into
    // row t of the stream's mapped host output; then the stream's signal.
    let table: Vec<f32> = (0..STREAMS * TASKS).flat_map(|i| std::iter::repeat_n((i + 1) as f32, W)).collect();
    let table = c.s.upload(&table).unwrap();
    let ids: Vec<u32> = (0..(STREAMS * TASKS) as u32).collect();
    let ids = c.s.upload(&ids).unwrap();
    let outs: Vec<PinnedMapped<f32>> =
        (0..STREAMS).map(|_| c.dev.pinned_mapped::<f32>(TASKS * W).unwrap()).collect();
    let streams: Vec<Stream> = (0..STREAMS).map(|_| c.dev.stream().unwrap()).collect();
    let counters = c.dev.signal_counters(STREAMS).unwrap();

    let (observed, checked) = std::thread::scope(|scope| {
        // The poller: acquire loads only, as the runtime's poller.
        let poller = scope.spawn(|| {
            let mut last = [0u64; STREAMS];
            let mut observed = 0usize;
            let mut checked = 0usize;
            let deadline = Instant::now() + Duration::from_secs(120);
            let mut row = vec![0f32; W];
            while last.iter().any(|&l| l < TASKS as u64) {
                for s in 0..STREAMS {
                    let now = counters.completed(s);
                    assert!(
                        now >= last[s] && now <= TASKS as u64,
                        "stream {s}: counter {} then {now}",
                        last[s]
                    );
                    if now > last[s] {
                        observed += 1;
                    }
                    // Every task counted so far has its output visible: the rows of tasks
                    // last..now were written by kernels queued before the signal whose release
                    // increment the acquire load above observed.
                    for t in last[s] as usize..now as usize {
                        outs[s].read(t * W, &mut row).unwrap();
                        let want = (s * TASKS + t + 1) as f32;
                        assert!(
                            row.iter().all(|&v| v == want),
                            "stream {s} count {now}: task {t}'s row not visible"
                        );
                        checked += 1;
                    }
                    last[s] = now;
                }
                assert!(Instant::now() < deadline, "counters stuck at {last:?}");
                std::hint::spin_loop();
            }
            (observed, checked)
        });
        for t in 0..TASKS {
            for (s, st) in streams.iter().enumerate() {
                let p = EmbeddingParams {
                    table: table.device_ptr(),
                    ids: ids.device_ptr_at(s * TASKS + t),
                    out: outs[s].device_ptr() + (t * W * 4) as u64,
                    table_rows: u32_of(STREAMS * TASKS),
                    width: u32_of(W),
                    batch: 1,
                    out_ld: u32_of(W),
                    ..EmbeddingParams::default()
                };
                // SAFETY: serve_embedding_gather takes one EmbeddingParams by value: one id (element
                // s·TASKS + t of `ids`, in range), a table row < table_rows of `table`
                // (STREAMS·TASKS rows of W), and one output row of W floats at row t of the
                // stream's mapped buffer (TASKS rows). All buffers outlive the scope (their drop
                // synchronises the context). The host reads an output row only after the acquire
                // load of the counter shows its task complete, and never writes it.
                unsafe { st.launch_with(embedding, LaunchConfig::linear(1, BLOCK), &p) }.unwrap();
                let sp = SignalParams { counter: counters.device_ptr(s) };
                // SAFETY: serve_signal takes one SignalParams by value; the counter is stream s's
                // line of the mapped counters, alive (an Arc held here) until after the scope,
                // written only by this stream's signal kernels and read by the host with atomics.
                unsafe { st.launch_with(signal, LaunchConfig::linear(1, 1), &sp) }.unwrap();
            }
        }
        poller.join().unwrap()
    });
    for st in &streams {
        st.synchronize().unwrap();
    }
    assert!((0..STREAMS).all(|s| counters.completed(s) == TASKS as u64));
    assert_eq!(checked, STREAMS * TASKS, "every task's output checked once");
    println!("poller saw {observed} counter changes over {} signals", STREAMS * TASKS);
}
