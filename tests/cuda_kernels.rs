//! Every hand-written CUDA kernel (`cuda/*.cu`) against the CPU backend on the same inputs
//! (ARCHITECTURE.md §9, issue 4 item 7), here the recurrent cells' (the embedding gather, dense
//! layers and completion signals are in `tests/cuda_kernels_io.rs`; the shared harness is
//! `tests/common/cuda_kernels.rs`):
//!
//! * LSTM layer steps — embedding gather → `serve_lstm_gather` → cuBLAS GEMM →
//!   `serve_lstm_pointwise` — for two stacked layers at batch sizes 1, 3, 64 and 512 (and
//!   h = 1024), scrambled slots, fresh rows (slots holding garbage that must not be read),
//!   padding rows and several steps, against `lstm_layer_step` on a `StateArena` with the same
//!   slots: `h_out` and every slot of the arena, to 1e-4 relative (TF32 off).
//! * `serve_argmax` against `project_argmax`, ties included (exact integer logits), the token
//!   stored in the row's slot and read back by the embedding gather (`SERVE_TOKEN_FROM_SLOT`),
//!   and NaN / ±inf rows against the CPU's documented rule.
//! * `serve_tree_gather` / `serve_tree_pointwise` (with the GEMMs between them) against
//!   `tree_step`, multi-child nodes, leaves and padding in one step.
//!
//! Each check runs on two targets (`tests/common/cuda_kernels.rs`): on device 0, and as
//! `*_on_host` on the same kernel sources compiled for the CPU (`cuda/host/`), so that every
//! kernel's arithmetic and indexing is checked against the CPU backend on any machine (the GEMMs
//! between kernels are cuBLAS on the GPU, `matrixmultiply` on the host). With no CUDA device
//! each GPU test prints `skipped: no CUDA device` and passes, unless `SERVE_REQUIRE_GPU=1`,
//! which makes a missing device (or a missing NVRTC / cuBLAS the test needs) a failure. Tests
//! named `host_*` check the harness's host-side references and run everywhere.

mod common;

use common::cuda_kernels::{
    Arena, Buf, Children, Dev, SlotTokens, arena_values, assert_close, concat_rows, flatten_children, gpu,
    host, mix, slot_word, span,
};

use serve::backend::cpu::arena::StateArena;
use serve::backend::cpu::gemm::Threads;
use serve::backend::cpu::lstm_cell::{
    LstmLayer, LstmRow, LstmScratch, Projection, StepInput, argmax, embed_rows, lstm_layer_step,
    project_argmax,
};
use serve::backend::cpu::tree_cell::{TreeCell, TreeRow, TreeScratch, tree_step};
use serve::backend::cuda::abi;
use serve::model::NO_TOKEN;
use serve::workload::values;

#[test]
fn host_helpers_lay_out_what_the_kernels_read() {
    let rows = [
        TreeRow { slot: 4, children: 1..4 },
        TreeRow { slot: 2, children: 4..4 },
        TreeRow { slot: 0, children: 0..1 },
    ];
    let (start, flat) = flatten_children(&rows, &[9, 7, 8, 6]);
    assert_eq!(start, [0, 3, 3, 4]);
    assert_eq!(flat, [7, 8, 6, 9]);
    assert_eq!(concat_rows(&[1.0, 2.0, 3.0, 4.0], 2, &[5.0, 6.0], 1), [1.0, 2.0, 5.0, 3.0, 4.0, 6.0]);
    assert_eq!(span(3, 4, 6), 16);
    assert_eq!(slot_word(5, true), 5 | 0x8000_0000);
}

// ---------------------------------------------------------------------------------------------
// LSTM steps.

/// A two-layer LSTM as the CPU and the GPU each hold it.
struct Lstm {
    vocab: usize,
    table: Vec<f32>,
    cpu: Vec<LstmLayer>,
    /// Per layer: `[W_ih | W_hh]` and `b_ih + b_hh` on the device.
    w: Vec<Buf<f32>>,
    bias: Vec<Buf<f32>>,
}

impl Lstm {
    fn new(g: &Dev, e: usize, h: usize, vocab: usize, seed: u64) -> Lstm {
        let s = 1.0 / (h as f32).sqrt();
        let (mut cpu, mut w, mut bias) = (Vec::new(), Vec::new(), Vec::new());
        for layer in 0..2u64 {
            let input = if layer == 0 { e } else { h };
            let k = seed * 10 + layer * 4;
            let w_ih = values(4 * h * input, k, s);
            let w_hh = values(4 * h * h, k + 1, s);
            let b_ih = values(4 * h, k + 2, s);
            let b_hh = values(4 * h, k + 3, s);
            cpu.push(LstmLayer::from_torch(&w_ih, &w_hh, &b_ih, &b_hh, input, h));
            w.push(g.upload(&concat_rows(&w_ih, input, &w_hh, h)).unwrap());
            let b: Vec<f32> = b_ih.iter().zip(&b_hh).map(|(a, b)| a + b).collect();
            bias.push(g.upload(&b).unwrap());
        }
        Lstm { vocab, table: values(vocab * e, seed * 10 + 9, 1.0), cpu, w, bias }
    }
}

/// Two stacked layers over `requests` requests for `steps` steps, GPU against CPU.
///
/// Slots are a scrambled permutation of an arena with spare slots; every slot starts with
/// garbage. Step 0 runs every request fresh; later steps leave some requests out (their slots
/// must stay untouched), reorder the rows, add 0–2 padding rows, and at step 2 restart some
/// requests in spare slots (fresh rows over garbage). Some rows have no token (zero input). The
/// second layer's input goes through `x` (even steps) or is written in place into its `[x | h]`
/// buffer by the first layer's pointwise kernel (odd steps).
fn check_lstm(g: &mut Dev, requests: usize, e: usize, h: usize, steps: usize, seed: u64) {
    let m = Lstm::new(g, e, h, 97 + requests, seed);
    let mut table = g.pinned::<f32>(m.table.len()).unwrap();
    table.write(0, &m.table).unwrap();
    let n_slots = 2 * requests + 3;
    let width = 4 * h + 1; // two layers' h and c, and a word that is never touched
    let cpu_arena = StateArena::new(n_slots, width).unwrap();
    for s in 0..n_slots as u32 {
        cpu_arena.write(s, 0, &values(width, 1000 + s as u64, 3.0));
    }
    let arena = Arena::upload(g, &cpu_arena);
    let mut perm: Vec<u32> = (0..n_slots as u32).collect();
    perm.sort_by_key(|&s| mix(s as u64, seed));
    let mut slot_of: Vec<u32> = perm[..requests].to_vec();
    let mut started = vec![false; requests];
    let mut spare = perm[requests..].iter().copied();
    let mut scratch = LstmScratch::new();
    let (e_h, h4) = (e + h, 4 * h);

    for step in 0..steps {
        if step == 2 {
            for (i, slot) in slot_of.iter_mut().enumerate() {
                if i % 4 == 1
                    && let Some(s) = spare.next()
                {
                    *slot = s;
                    started[i] = false;
                }
            }
        }
        let mut active: Vec<usize> =
            (0..requests).filter(|&i| step == 0 || (i * 7 + step) % 5 != 0).collect();
        active.sort_by_key(|&i| mix(i as u64, ((step as u64) << 32) | seed));
        let rows: Vec<LstmRow> =
            active.iter().map(|&i| LstmRow { slot: slot_of[i], fresh: !started[i] }).collect();
        let padded = rows.len() + step % 3;
        let mut ids: Vec<u32> = active
            .iter()
            .map(|&i| {
                if (i + step) % 6 == 5 {
                    NO_TOKEN
                } else {
                    (mix(i as u64, step as u64) % m.vocab as u64) as u32
                }
            })
            .collect();
        ids.resize(padded, NO_TOKEN);
        let what =
            format!("requests {requests}, E {e}, H {h}, step {step} ({} rows, padded {padded})", rows.len());

        // CPU.
        let mut x0 = vec![0.0; padded * e];
        embed_rows(&m.table, e, &ids, &mut x0);
        let mut h0 = vec![f32::NAN; padded * h];
        let mut h1 = vec![f32::NAN; padded * h];
        lstm_layer_step(
            &m.cpu[0],
            StepInput::Values(&x0),
            &rows,
            padded,
            &cpu_arena,
            0,
            &mut scratch,
            &mut h0,
            Threads(1),
        );
        lstm_layer_step(
            &m.cpu[1],
            StepInput::Values(&h0),
            &rows,
            padded,
            &cpu_arena,
            2 * h,
            &mut scratch,
            &mut h1,
            Threads(1),
        );

        // GPU.
        let gpu_before = g.download(&arena.buf).unwrap();
        let ids_d = g.upload(&ids).unwrap();
        let words: Vec<u32> = rows.iter().map(|r| slot_word(r.slot, r.fresh)).collect();
        let slots_d = g.upload(&words).unwrap();
        let xh0 = g.upload(&vec![f32::NAN; padded * e_h]).unwrap();
        let xh1 = g.upload(&vec![f32::NAN; padded * 2 * h]).unwrap();
        let h0_d = g.upload(&vec![f32::NAN; padded * h]).unwrap();
        let h1_d = g.upload(&vec![f32::NAN; padded * h]).unwrap();
        let errors = g.upload(&vec![0xDEAD_BEEFu32; padded]).unwrap();
        let mut gates = g.alloc::<f32>(padded * h4).unwrap();
        g.embed(&table, m.vocab, e, &ids_d, None, &xh0, e_h, Some(&errors));
        g.lstm_gather(None, &slots_d, rows.len(), &arena, &xh0, (e, h), padded, 0);
        g.gemm((padded, h4, e_h), &xh0, &m.w[0], &mut gates);
        let in_place = step % 2 == 1;
        if in_place {
            g.lstm_pointwise(&gates, &m.bias[0], &slots_d, rows.len(), &arena, (&xh1, 2 * h), h, padded, 0);
            g.lstm_gather(None, &slots_d, rows.len(), &arena, &xh1, (h, h), padded, 2 * h);
        } else {
            g.lstm_pointwise(&gates, &m.bias[0], &slots_d, rows.len(), &arena, (&h0_d, h), h, padded, 0);
            g.lstm_gather(Some((&h0_d, h)), &slots_d, rows.len(), &arena, &xh1, (h, h), padded, 2 * h);
        }
        g.gemm((padded, h4, 2 * h), &xh1, &m.w[1], &mut gates);
        g.lstm_pointwise(&gates, &m.bias[1], &slots_d, rows.len(), &arena, (&h1_d, h), h, padded, 2 * h);

        assert!(g.download(&errors).unwrap().iter().all(|&w| w == abi::SERVE_ROW_OK), "{what}: error words");
        let got_h0: Vec<f32> = if in_place {
            g.download(&xh1).unwrap().chunks_exact(2 * h).flat_map(|r| r[..h].to_vec()).collect()
        } else {
            g.download(&h0_d).unwrap()
        };
        assert_close(&got_h0, &h0, &format!("{what}: layer 0 h_out"));
        assert_close(&g.download(&h1_d).unwrap(), &h1, &format!("{what}: layer 1 h_out"));
        let got = g.download(&arena.buf).unwrap();
        let want = arena_values(&cpu_arena);
        for s in 0..n_slots {
            let (got, want) = (&got[s * width..(s + 1) * width], &want[s * width..(s + 1) * width]);
            if rows.iter().any(|r| r.slot as usize == s) {
                assert_close(&got[..4 * h], &want[..4 * h], &format!("{what}: slot {s}"));
                assert_eq!(got[4 * h].to_bits(), want[4 * h].to_bits(), "{what}: slot {s}'s last word");
            } else {
                // Bit for bit as before the step (slots of earlier steps hold the GPU's own
                // rounding, within the tolerance of the CPU's).
                let before = &gpu_before[s * width..(s + 1) * width];
                let same = got.iter().zip(before).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{what}: slot {s} is not in the step and must be untouched");
                assert_close(got, want, &format!("{what}: slot {s}"));
            }
        }
        for &i in &active {
            started[i] = true;
        }
    }
}

on_gpu_and_host!(check_lstm_small(true): lstm_step_matches_the_cpu_at_batch_1_and_3, lstm_step_matches_the_cpu_at_batch_1_and_3_on_host);

fn check_lstm_small(mut g: Dev) {
    check_lstm(&mut g, 1, 8, 16, 5, 1);
    // Odd widths: the embedding gather's scalar path, unaligned rows of [x | h].
    check_lstm(&mut g, 3, 37, 29, 5, 2);
}

on_gpu_and_host!(check_lstm_batches(true): lstm_step_matches_the_cpu_at_batch_64_and_512, lstm_step_matches_the_cpu_at_batch_64_and_512_on_host);

fn check_lstm_batches(mut g: Dev) {
    check_lstm(&mut g, 64, 64, 128, 4, 3);
    check_lstm(&mut g, 512, 32, 64, 4, 4);
}

#[test]
fn lstm_step_matches_the_cpu_at_gpu_scale() {
    let Some(mut g) = gpu(true) else { return };
    // h = 1024 as benchmarked (ARCHITECTURE.md §8's GPU scale), batch 64.
    check_lstm(&mut g, 64, 1024, 1024, 3, 5);
}

// ---------------------------------------------------------------------------------------------
// Argmax.

on_gpu_and_host!(check_argmax_ties(true): argmax_matches_project_argmax_with_ties_and_feeds_the_next_embedding, argmax_matches_project_argmax_with_ties_and_feeds_the_next_embedding_on_host);

fn check_argmax_ties(mut g: Dev) {
    // Small integers: every logit is exact on both sides whatever the summation order, so ties are
    // real ties. Vocabularies below a warp, across several warps, and much larger than a block.
    for (hd, vocab, rows) in [(64usize, 20usize, 5usize), (64, 1000, 37), (32, 30522, 7)] {
        let w: Vec<f32> = (0..vocab * hd).map(|i| (mix(i as u64, vocab as u64) % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..vocab).map(|i| (mix(i as u64, 77) % 11) as f32 - 5.0).collect();
        let h: Vec<f32> = (0..rows * hd).map(|i| (mix(i as u64, 78) % 5) as f32 - 2.0).collect();
        let p = Projection::from_torch(&w, &b);
        let mut logits = vec![0.0; rows * vocab];
        let mut want = vec![0u32; rows];
        project_argmax(&p, &h, rows, &mut logits, &mut want, Threads(1));

        // Tokens stored in slots: rows use scrambled slots (flag bits set on some, which the kernel
        // ignores); the last row's slot is out of range (the token is still output, nothing stored).
        let n_slots = rows + 4;
        let width = 3;
        let cpu_arena = StateArena::new(n_slots, width).unwrap();
        for s in 0..n_slots as u32 {
            cpu_arena.write(s, 0, &values(width, 50 + s as u64, 1.0));
        }
        let arena = Arena::upload(&g, &cpu_arena);
        let mut words: Vec<u32> =
            (0..rows as u32).map(|r| slot_word((r * 5 + 2) % n_slots as u32, r % 2 == 0)).collect();
        *words.last_mut().unwrap() = n_slots as u32 + 7;
        let slots_d = g.upload(&words).unwrap();

        let (h_d, w_d, b_d) = (g.upload(&h).unwrap(), g.upload(&w).unwrap(), g.upload(&b).unwrap());
        let mut logits_d = g.alloc::<f32>(rows * vocab).unwrap();
        g.gemm((rows, vocab, hd), &h_d, &w_d, &mut logits_d);
        let tokens = g.upload(&vec![u32::MAX; rows]).unwrap();
        g.argmax(&logits_d, Some(&b_d), (rows, vocab), Some((&slots_d, &arena, 1)), &tokens);
        let got = g.download(&tokens).unwrap();
        assert_eq!(got, want, "vocab {vocab}: GPU argmax vs project_argmax");
        let ties = (0..rows)
            .filter(|&r| {
                let row = &logits[r * vocab..(r + 1) * vocab];
                row.iter().filter(|&&x| x == row[want[r] as usize]).count() > 1
            })
            .count();
        println!("vocab {vocab}: {ties} of {rows} rows have tied maxima");

        let before = arena_values(&cpu_arena);
        let after = g.download(&arena.buf).unwrap();
        for s in 0..n_slots {
            for j in 0..width {
                let stored =
                    words[..rows - 1].iter().position(|&wd| (wd & abi::SERVE_SLOT_MASK) as usize == s);
                let (a, b) = (after[s * width + j].to_bits(), before[s * width + j].to_bits());
                match stored {
                    Some(r) if j == 1 => assert_eq!(a, want[r], "slot {s} holds row {r}'s token"),
                    _ => assert_eq!(a, b, "slot {s} word {j} untouched"),
                }
            }
        }

        // The next decoder step: SERVE_TOKEN_FROM_SLOT rows embed the token stored in their slot.
        let e = 16;
        let table = values(vocab * e, 90, 1.0);
        let table_d = g.upload(&table).unwrap();
        let ids_d = g.upload(&vec![abi::SERVE_TOKEN_FROM_SLOT; rows]).unwrap();
        let out = g.alloc::<f32>(rows * e).unwrap();
        let errors = g.alloc::<u32>(rows).unwrap();
        let from = SlotTokens { slots: &slots_d, arena: &arena, token_offset: 1 };
        g.embed(&table_d, vocab, e, &ids_d, Some(&from), &out, e, Some(&errors));
        let mut ref_ids = want.clone();
        *ref_ids.last_mut().unwrap() = NO_TOKEN; // its slot is out of range: a bad row, zeros
        let mut x = vec![0.0; rows * e];
        embed_rows(&table, e, &ref_ids, &mut x);
        assert_eq!(g.download(&out).unwrap(), x);
        let mut flags = vec![abi::SERVE_ROW_OK; rows];
        *flags.last_mut().unwrap() = abi::SERVE_ROW_BAD_TOKEN;
        assert_eq!(g.download(&errors).unwrap(), flags);
    }
}

on_gpu_and_host!(check_argmax_non_finite(false): argmax_of_nan_and_infinite_logits_follows_the_cpu_rule, argmax_of_nan_and_infinite_logits_follows_the_cpu_rule_on_host);

fn check_argmax_non_finite(g: Dev) {
    let vocab = 700;
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let mut cases: Vec<Vec<f32>> = Vec::new();
    let row = |f: &dyn Fn(usize) -> f32| (0..vocab).map(f).collect::<Vec<f32>>();
    cases.push(row(&|_| nan)); // all NaN: 0
    cases.push(row(&|_| -inf)); // nothing beats -inf: 0
    cases.push(row(&|j| if j % 2 == 0 { nan } else { -inf }));
    cases.push(row(&|j| if j == 0 { nan } else { j as f32 % 17.0 })); // NaN first
    cases.push(row(&|j| if j == 699 { 5.0 } else { -1.0 })); // maximum last
    cases.push(row(&|j| if j == 300 || j == 556 || j == 45 { 9.0 } else { 0.0 })); // ties across threads
    cases.push(row(&|j| if j == 33 || j == 1 { 2.0 } else { 1.0 })); // ties across warps of one thread stride
    cases.push(row(&|j| {
        if j == 400 {
            inf
        } else if j == 401 {
            nan
        } else {
            1e30
        }
    }));
    cases.push(row(&|j| if j > 600 { inf } else { 0.0 })); // several +inf: the first
    cases.push(row(&|j| -(j as f32))); // maximum first
    cases.push(row(&|j| if j == 5 { -inf } else { nan })); // -inf is not > -inf
    cases.push(row(&|j| if j == 650 { -3.0e38 } else { nan }));
    let rows = cases.len();
    let logits: Vec<f32> = cases.concat();
    let logits_d = g.upload(&logits).unwrap();
    let tokens = g.upload(&vec![u32::MAX; rows]).unwrap();
    g.argmax(&logits_d, None, (rows, vocab), None, &tokens);
    let got = g.download(&tokens).unwrap();
    let want: Vec<u32> = cases.iter().map(|c| argmax(c)).collect();
    assert_eq!(got, want);
}

// ---------------------------------------------------------------------------------------------
// TreeLSTM.

struct Tree {
    e: usize,
    h: usize,
    cpu: TreeCell,
    wx: Buf<f32>,
    bias: Buf<f32>,
    u_iou: Buf<f32>,
    u_f: Buf<f32>,
}

impl Tree {
    fn new(g: &Dev, e: usize, h: usize, seed: u64) -> Tree {
        let s = 1.0 / (h as f32).sqrt();
        let k = seed * 10;
        let (w_iou, b_iou, u_iou) =
            (values(3 * h * e, k, s), values(3 * h, k + 1, s), values(3 * h * h, k + 2, s));
        let (w_f, b_f, u_f) = (values(h * e, k + 3, s), values(h, k + 4, s), values(h * h, k + 5, s));
        let cpu = TreeCell::from_torch(&w_iou, &b_iou, &u_iou, &w_f, &b_f, &u_f, e, h);
        let wx: Vec<f32> = w_iou.iter().chain(&w_f).copied().collect();
        let bias: Vec<f32> = b_iou.iter().chain(&b_f).copied().collect();
        Tree {
            e,
            h,
            cpu,
            wx: g.upload(&wx).unwrap(),
            bias: g.upload(&bias).unwrap(),
            u_iou: g.upload(&u_iou).unwrap(),
            u_f: g.upload(&u_f).unwrap(),
        }
    }
}

/// One TreeLSTM step of `nodes` (slot, child slots) padded to `padded` rows, GPU against CPU, on
/// arenas that start equal; checks h_out and every slot.
fn check_tree_step(
    g: &mut Dev,
    t: &Tree,
    (cpu_arena, arena): (&StateArena, &Arena),
    nodes: &[(u32, Vec<u32>)],
    padded: usize,
    seed: u64,
) {
    let (e, hd) = (t.e, t.h);
    // CPU child ranges start after an unused entry, as a real step's may.
    let mut child_slots = vec![u32::MAX];
    let rows: Vec<TreeRow> = nodes
        .iter()
        .map(|(slot, ch)| {
            let start = child_slots.len();
            child_slots.extend(ch);
            TreeRow { slot: *slot, children: start..child_slots.len() }
        })
        .collect();
    let mut x = values(padded * e, seed, 1.0);
    x[nodes.len() * e..].fill(0.0);
    let what = format!("tree step of {} nodes (padded {padded}), E {e}, H {hd}", nodes.len());

    let gpu_before = g.download(&arena.buf).unwrap();
    let mut scratch = TreeScratch::new();
    let mut h_cpu = vec![f32::NAN; padded * hd];
    tree_step(&t.cpu, &x, &rows, &child_slots, padded, cpu_arena, &mut scratch, &mut h_cpu, Threads(1));

    let (start, flat) = flatten_children(&rows, &child_slots);
    let ch = Children::new(g, &start, &flat);
    // The flag bit of node and child slot words is ignored: set it on some.
    let node_words: Vec<u32> = nodes.iter().enumerate().map(|(i, n)| slot_word(n.0, i % 3 == 1)).collect();
    let node_slots = g.upload(&node_words).unwrap();
    let x_d = g.upload(&x).unwrap();
    let mut gx = g.alloc::<f32>(padded * 4 * hd).unwrap();
    let h_out = g.upload(&vec![f32::NAN; padded * hd]).unwrap();
    g.gemm((padded, 4 * hd, e), &x_d, &t.wx, &mut gx);
    if ch.total > 0 {
        let h_sum = g.upload(&vec![f32::NAN; padded * hd]).unwrap();
        let child_h = g.upload(&vec![f32::NAN; ch.total * hd]).unwrap();
        let child_c = g.upload(&vec![f32::NAN; ch.total * hd]).unwrap();
        let mut gu = g.alloc::<f32>(padded * 3 * hd).unwrap();
        let mut fu = g.alloc::<f32>(ch.total * hd).unwrap();
        g.tree_gather(&ch, arena, &h_sum, &child_h, &child_c, hd, padded);
        g.gemm((padded, 3 * hd, hd), &h_sum, &t.u_iou, &mut gu);
        g.gemm((ch.total, hd, hd), &child_h, &t.u_f, &mut fu);
        g.tree_pointwise(
            &gx,
            Some(&gu),
            &t.bias,
            &ch,
            Some((&fu, &child_c)),
            &node_slots,
            arena,
            &h_out,
            hd,
            padded,
        );
        // h̃ is the children's h summed in child order (the CPU's order).
        let sums = g.download(&h_sum).unwrap();
        for (r, w) in start.windows(2).enumerate() {
            let mut want = vec![0.0f32; hd];
            for q in w[0]..w[1] {
                let mut hk = vec![0.0; hd];
                cpu_arena.read(flat[q as usize], 0, &mut hk);
                want.iter_mut().zip(&hk).for_each(|(a, b)| *a += b);
            }
            // Children are read before this step's scatter, which may not overwrite them (a node
            // is never its own child), so the CPU arena still holds what the GPU read.
            assert_close(&sums[r * hd..(r + 1) * hd], &want, &format!("{what}: h_sum row {r}"));
        }
        assert!(sums[nodes.len() * hd..].iter().all(|&v| v == 0.0), "{what}: padding rows' h_sum");
    } else {
        g.tree_pointwise(&gx, None, &t.bias, &ch, None, &node_slots, arena, &h_out, hd, padded);
    }
    assert_close(&g.download(&h_out).unwrap(), &h_cpu, &format!("{what}: h_out"));
    let got = g.download(&arena.buf).unwrap();
    let want = arena_values(cpu_arena);
    let w = arena.width;
    for s in 0..arena.slots {
        let (got, want) = (&got[s * w..(s + 1) * w], &want[s * w..(s + 1) * w]);
        let before = &gpu_before[s * w..(s + 1) * w];
        // Written words within the tolerance of the CPU's; the others bit for bit as before the
        // step (slots of earlier steps hold the GPU's own rounding).
        let written = if nodes.iter().any(|n| n.0 as usize == s) { 2 * hd } else { 0 };
        assert_close(got, want, &format!("{what}: slot {s}"));
        let same = got[written..].iter().zip(&before[written..]).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: slot {s}: words from {written} on must be untouched");
    }
}

on_gpu_and_host!(check_tree_steps(true): tree_step_matches_the_cpu_with_multi_child_nodes, tree_step_matches_the_cpu_with_multi_child_nodes_on_host);

fn check_tree_steps(mut g: Dev) {
    // The CPU test's tree: leaves, then a three-child node, a leaf and a one-child node in one
    // step, then the root over two internal nodes.
    let (e, hd) = (12, 20);
    let t = Tree::new(&g, e, hd, 1);
    let cpu_arena = StateArena::new(10, 2 * hd + 1).unwrap();
    for s in 0..10 {
        cpu_arena.write(s, 0, &values(2 * hd + 1, 60 + s as u64, 3.0));
    }
    let arena = Arena::upload(&g, &cpu_arena);
    let a = (&cpu_arena, &arena);
    check_tree_step(&mut g, &t, a, &[7, 2, 5, 0].map(|s| (s, vec![])), 6, 1);
    check_tree_step(&mut g, &t, a, &[(9, vec![7, 2, 5]), (4, vec![]), (3, vec![0])], 4, 2);
    check_tree_step(&mut g, &t, a, &[(1, vec![9, 3])], 2, 3);
    check_tree_step(&mut g, &t, a, &[(8, vec![1, 4, 6, 2, 5])], 1, 4); // five children, one unwritten (garbage is data)

    // Batches of 1, 3, 64 and 300 nodes at a wider size: leaves, then parents with 0..=3 children.
    for n in [1usize, 3, 64, 300] {
        let (e, hd) = (48, 96);
        let t = Tree::new(&g, e, hd, 2 + n as u64);
        let slots = 2 * n + 1;
        let cpu_arena = StateArena::new(slots, 2 * hd).unwrap();
        for s in 0..slots as u32 {
            cpu_arena.write(s, 0, &values(2 * hd, 70 + s as u64, 2.0));
        }
        let arena = Arena::upload(&g, &cpu_arena);
        let mut order: Vec<u32> = (0..slots as u32).collect();
        order.sort_by_key(|&s| mix(s as u64, n as u64));
        let leaves: Vec<(u32, Vec<u32>)> = order[..n].iter().map(|&s| (s, vec![])).collect();
        check_tree_step(&mut g, &t, (&cpu_arena, &arena), &leaves, n + 2, 10 + n as u64);
        let parents: Vec<(u32, Vec<u32>)> = (0..n)
            .map(|p| (order[n + p], (0..p % 4).map(|k| order[(p * 5 + k * 3) % n]).collect()))
            .collect();
        check_tree_step(&mut g, &t, (&cpu_arena, &arena), &parents, n + 1, 20 + n as u64);
    }
}
