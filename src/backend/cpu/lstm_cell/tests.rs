//! Tests of the LSTM step kernels against an f64 reference (lstm_cell.rs).

use super::*;
use crate::backend::cpu::test_util::{Pool, pool, slot_values};
use crate::workload::values;

/// PyTorch's tensors of one layer.
struct Torch {
    w_ih: Vec<f32>,
    w_hh: Vec<f32>,
    b_ih: Vec<f32>,
    b_hh: Vec<f32>,
    input: usize,
    hidden: usize,
}

impl Torch {
    fn new(input: usize, hidden: usize, seed: u64) -> Torch {
        let s = 1.0 / (hidden as f32).sqrt();
        Torch {
            w_ih: values(4 * hidden * input, seed, s),
            w_hh: values(4 * hidden * hidden, seed + 1, s),
            b_ih: values(4 * hidden, seed + 2, s),
            b_hh: values(4 * hidden, seed + 3, s),
            input,
            hidden,
        }
    }
    fn layer(&self) -> LstmLayer {
        LstmLayer::from_torch(&self.w_ih, &self.w_hh, &self.b_ih, &self.b_hh, self.input, self.hidden)
    }

    /// The reference cell in f64: (h, c) from x, h_prev, c_prev.
    fn cell(&self, x: &[f32], h: &[f64], c: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let (inp, hd) = (self.input, self.hidden);
        let gate = |j: usize| {
            let mut acc = self.b_ih[j] as f64 + self.b_hh[j] as f64;
            let wi = &self.w_ih[j * inp..(j + 1) * inp];
            let wh = &self.w_hh[j * hd..(j + 1) * hd];
            acc += wi.iter().zip(x).map(|(&w, &v)| w as f64 * v as f64).sum::<f64>();
            acc += wh.iter().zip(h).map(|(&w, &v)| w as f64 * v).sum::<f64>();
            acc
        };
        let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
        let (mut h2, mut c2) = (vec![0.0; hd], vec![0.0; hd]);
        for j in 0..hd {
            let (i, f, g, o) =
                (sig(gate(j)), sig(gate(hd + j)), gate(2 * hd + j).tanh(), sig(gate(3 * hd + j)));
            c2[j] = f * c[j] + i * g;
            h2[j] = o * c2[j].tanh();
        }
        (h2, c2)
    }
}

fn close(got: f32, want: f64) -> bool {
    (got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0)
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(close(g, w), "{what}[{j}]: got {g}, want {w}");
    }
}

/// Several steps of one layer over `n` requests in a `padded` batch, with scrambled slots,
/// restarts and untouched slots, against the f64 reference.
fn run_sequence(input: usize, hidden: usize, n: usize, padded: usize, threads: Threads, pool: &Pool) {
    let t = Torch::new(input, hidden, 11 + n as u64);
    let layer = t.layer();
    assert_eq!((layer.input(), layer.hidden()), (input, hidden));
    // State lives at offset 3 of slots of 2H + 5 values; the requests use the first n slots
    // of a scrambled list of 2n + 3, the others must stay untouched.
    let slots = 2 * n + 3;
    let offset = 3;
    let arena = StateArena::new(slots, 2 * hidden + 5).unwrap();
    let sentinel: Vec<Vec<f32>> = (0..slots).map(|s| values(arena.width(), 100 + s as u64, 9.0)).collect();
    for (s, v) in sentinel.iter().enumerate() {
        arena.write(s as u32, 0, v);
    }
    let mut order: Vec<u32> = (0..slots as u32).collect();
    order.sort_by_key(|&s| (s as u64 * 2_654_435_761) % 1009);
    let used = &order[..n];
    let mut scratch = LstmScratch::new();
    scratch.reserve(padded, input, hidden).unwrap();
    let mut state: Vec<(Vec<f64>, Vec<f64>)> = vec![(vec![0.0; hidden], vec![0.0; hidden]); n];
    for step in 0..4 {
        // Step 0: everyone fresh; step 2: every third request restarts.
        let fresh: Vec<bool> = (0..n).map(|r| step == 0 || (step == 2 && r % 3 == 1)).collect();
        let rows: Vec<LstmRow> = (0..n).map(|r| LstmRow { slot: used[r], fresh: fresh[r] }).collect();
        let mut x = values(padded * input, 1000 + step, 1.0);
        x[n * input..].fill(0.0);
        let mut h_out = vec![f32::NAN; padded * hidden];
        pool.install(|| {
            lstm_layer_step(
                &layer,
                StepInput::Values(&x),
                &rows,
                padded,
                &arena,
                offset,
                &mut scratch,
                &mut h_out,
                threads,
            )
        });
        for r in 0..padded {
            let zero = vec![0.0; hidden];
            let (hp, cp) = if r < n && !fresh[r] { (&state[r].0, &state[r].1) } else { (&zero, &zero) };
            let (h, c) = t.cell(&x[r * input..(r + 1) * input], hp, cp);
            let what = format!("n={n} padded={padded} {threads:?} step {step} row {r}");
            assert_close(&h_out[r * hidden..(r + 1) * hidden], &h, &format!("{what} h_out"));
            if r < n {
                let slot = slot_values(&arena, used[r]);
                assert_close(&slot[offset..offset + hidden], &h, &format!("{what} slot h"));
                assert_close(&slot[offset + hidden..offset + 2 * hidden], &c, &format!("{what} slot c"));
                assert_eq!(
                    &slot[..offset],
                    &sentinel[used[r] as usize][..offset],
                    "{what}: before the state"
                );
                assert_eq!(
                    &slot[offset + 2 * hidden..],
                    &sentinel[used[r] as usize][offset + 2 * hidden..],
                    "{what}: after the state"
                );
                state[r] = (h, c);
            }
        }
        for &s in &order[n..] {
            assert_eq!(slot_values(&arena, s), sentinel[s as usize], "untouched slot {s}");
        }
    }
}

#[test]
fn lstm_step_matches_reference_for_batch_sizes() {
    let pool = pool();
    let sizes: &[(usize, usize)] =
        if cfg!(miri) { &[(1, 1), (3, 4)] } else { &[(1, 1), (3, 4), (17, 24), (64, 64), (64, 67)] };
    // Hidden sizes on both sides of AVX2_MIN_HIDDEN, with and without a remainder past the
    // vector width (the pointwise kernel's two builds).
    let hiddens: &[usize] = if cfg!(miri) { &[7] } else { &[4, 7, 8, 12] };
    for &hidden in hiddens {
        for &(n, padded) in sizes {
            for threads in pool.threads() {
                run_sequence(5, hidden, n, padded, threads, &pool);
            }
        }
    }
}

#[test]
fn lstm_step_parallel_kernels_match_reference() {
    if cfg!(miri) {
        return;
    }
    // padded × H ≥ PARALLEL_MIN_VALUES: the gather and pointwise kernels run on the pool.
    let pool = pool();
    const { assert!(256 * 64 >= PARALLEL_MIN_VALUES) };
    for threads in pool.threads() {
        run_sequence(24, 64, 250, 256, threads, &pool);
    }
}

#[test]
fn lstm_rows_use_scrambled_slots_and_leave_others_untouched() {
    let (input, hidden) = (3, 4);
    let t = Torch::new(input, hidden, 5);
    let layer = t.layer();
    // Layer 1 of a two-layer model: its state at offset 2H of 4H-value slots.
    let arena = StateArena::new(10, 4 * hidden).unwrap();
    for s in 0..10 {
        arena.write(s, 0, &vec![s as f32 + 0.5; 4 * hidden]);
    }
    let rows = [7, 2, 5].map(|slot| LstmRow { slot, fresh: false });
    let x = values(4 * input, 3, 1.0);
    let mut h_out = vec![0.0; 4 * hidden];
    let mut scratch = LstmScratch::new();
    lstm_layer_step(
        &layer,
        StepInput::Values(&x),
        &rows,
        4,
        &arena,
        2 * hidden,
        &mut scratch,
        &mut h_out,
        Threads(1),
    );
    for (r, row) in rows.iter().enumerate() {
        let prev = vec![row.slot as f64 + 0.5; hidden];
        let (h, c) = t.cell(&x[r * input..(r + 1) * input], &prev, &prev);
        let slot = slot_values(&arena, row.slot);
        assert_eq!(&slot[..2 * hidden], &vec![row.slot as f32 + 0.5; 2 * hidden][..], "layer 0 state kept");
        assert_close(&slot[2 * hidden..3 * hidden], &h, "h");
        assert_close(&slot[3 * hidden..], &c, "c");
        assert_close(&h_out[r * hidden..(r + 1) * hidden], &h, "h_out");
    }
    for s in [0, 1, 3, 4, 6, 8, 9] {
        assert_eq!(slot_values(&arena, s), vec![s as f32 + 0.5; 4 * hidden], "slot {s}");
    }
}

#[test]
fn two_layer_sequence_feeds_h_out_forward() {
    let (embed, hidden, vocab, n, padded) = (6, 5, 9, 3, 4);
    let l0 = Torch::new(embed, hidden, 21);
    let l1 = Torch::new(hidden, hidden, 31);
    let (layer0, layer1) = (l0.layer(), l1.layer());
    let table = values(vocab * embed, 41, 1.0);
    let arena = StateArena::new(6, 4 * hidden).unwrap();
    let slots = [4u32, 0, 3];
    let mut scratch = LstmScratch::new();
    scratch.reserve(padded, embed, hidden).unwrap();
    scratch.reserve(padded, hidden, hidden).unwrap();
    let zero = vec![0.0f64; hidden];
    let mut want: Vec<[(Vec<f64>, Vec<f64>); 2]> =
        vec![[(zero.clone(), zero.clone()), (zero.clone(), zero)]; n];
    let pool = pool();
    let threads = *pool.threads().last().unwrap();
    for step in 0..5u32 {
        // Request 2 joins at step 2; its row is empty (NO_TOKEN) before.
        let ids: Vec<u32> = (0..padded as u32)
            .map(|r| if r as usize >= n || (r == 2 && step < 2) { NO_TOKEN } else { (r * 5 + step * 3) % 9 })
            .collect();
        let active = if step < 2 { 2 } else { 3 };
        let rows: Vec<LstmRow> = (0..active)
            .map(|r| LstmRow { slot: slots[r], fresh: step == 0 || (r == 2 && step == 2) })
            .collect();
        let mut x = vec![f32::NAN; padded * embed];
        embed_rows(&table, embed, &ids, &mut x);
        let (mut h0, mut h1) = (vec![0.0; padded * hidden], vec![0.0; padded * hidden]);
        pool.install(|| {
            lstm_layer_step(
                &layer0,
                StepInput::Values(&x),
                &rows,
                padded,
                &arena,
                0,
                &mut scratch,
                &mut h0,
                threads,
            );
            lstm_layer_step(
                &layer1,
                StepInput::Values(&h0),
                &rows,
                padded,
                &arena,
                2 * hidden,
                &mut scratch,
                &mut h1,
                threads,
            );
        });
        for (r, row) in rows.iter().enumerate() {
            if row.fresh {
                want[r].iter_mut().for_each(|s| s.0.iter_mut().chain(&mut s.1).for_each(|v| *v = 0.0));
            }
            let xr = &table[ids[r] as usize * embed..][..embed];
            let (ha, ca) = l0.cell(xr, &want[r][0].0, &want[r][0].1);
            let ha32: Vec<f32> = ha.iter().map(|&v| v as f32).collect();
            let (hb, cb) = l1.cell(&ha32, &want[r][1].0, &want[r][1].1);
            assert_close(&h0[r * hidden..(r + 1) * hidden], &ha, &format!("step {step} row {r} layer 0"));
            assert_close(&h1[r * hidden..(r + 1) * hidden], &hb, &format!("step {step} row {r} layer 1"));
            want[r] = [(ha, ca), (hb, cb)];
        }
    }
}

/// A folded layer 0 (token-gate table) computes what the unfolded layer computes from the
/// gathered embedding: fresh and continuing rows, a row without a token (zero embedding),
/// padding rows, scrambled slots, several steps, one thread and the pool.
#[test]
fn folded_layer_matches_the_embedding_and_unfolded_layer() {
    let (embed, hidden, vocab, padded) = (6, 5, 11, 5);
    let t = Torch::new(embed, hidden, 51);
    let table = values(vocab * embed, 52, 1.0);
    let pool = pool();
    for threads in pool.threads() {
        let folded = pool
            .install(|| {
                LstmLayer::fold_embedding(&t.w_ih, &t.w_hh, &t.b_ih, &t.b_hh, &table, embed, hidden, threads)
            })
            .unwrap();
        assert!(folded.is_folded() && !t.layer().is_folded());
        assert_eq!((folded.input(), folded.hidden()), (embed, hidden));
        let arena = StateArena::new(8, 2 * hidden).unwrap();
        let slots = [6u32, 1, 3];
        let mut want = vec![(vec![0.0f64; hidden], vec![0.0f64; hidden]); 3];
        let mut scratch = LstmScratch::new();
        for step in 0..4u32 {
            // Row 1 has no token at step 1 (its input is a zero embedding).
            let ids: Vec<u32> = (0..padded as u32)
                .map(|r| match r {
                    3.. => NO_TOKEN,
                    1 if step == 1 => NO_TOKEN,
                    _ => (r * 7 + step * 3) % vocab as u32,
                })
                .collect();
            let rows: Vec<LstmRow> = slots
                .iter()
                .enumerate()
                .map(|(r, &slot)| LstmRow { slot, fresh: step == 0 || (r == 2 && step == 2) })
                .collect();
            let mut h_out = vec![f32::NAN; padded * hidden];
            pool.install(|| {
                lstm_layer_step(
                    &folded,
                    StepInput::Tokens(&ids),
                    &rows,
                    padded,
                    &arena,
                    0,
                    &mut scratch,
                    &mut h_out,
                    threads,
                )
            });
            let mut x = vec![0.0; padded * embed];
            embed_rows(&table, embed, &ids, &mut x);
            for r in 0..padded {
                let zero = vec![0.0; hidden];
                let fresh = rows.get(r).is_none_or(|row| row.fresh);
                let (hp, cp) = if fresh { (&zero, &zero) } else { (&want[r].0, &want[r].1) };
                let (h, c) = t.cell(&x[r * embed..(r + 1) * embed], hp, cp);
                let what = format!("{threads:?} step {step} row {r}");
                assert_close(&h_out[r * hidden..(r + 1) * hidden], &h, &what);
                if r < rows.len() {
                    let slot = slot_values(&arena, slots[r]);
                    assert_close(&slot[..hidden], &h, &format!("{what} slot h"));
                    assert_close(&slot[hidden..], &c, &format!("{what} slot c"));
                    want[r] = (h, c);
                }
            }
        }
    }
    assert_eq!(LstmLayer::token_gates_bytes(30_000, 256), 30_000 * 4 * 256 * 4);
    assert_eq!(LstmLayer::token_gates_bytes(usize::MAX, 2), usize::MAX);
}

/// One step of a small folded layer (vocab 11, input 2, hidden 3) on one fresh row.
fn folded_step(x: StepInput<'_>) {
    let t = Torch::new(2, 3, 1);
    let layer =
        LstmLayer::fold_embedding(&t.w_ih, &t.w_hh, &t.b_ih, &t.b_hh, &[0.5; 22], 2, 3, Threads(1)).unwrap();
    let arena = StateArena::new(1, 6).unwrap();
    let rows = [LstmRow { slot: 0, fresh: true }];
    let mut h = [0.0; 3];
    lstm_layer_step(&layer, x, &rows, 1, &arena, 0, &mut LstmScratch::new(), &mut h, Threads(1));
}

#[test]
#[should_panic(expected = "token id 11 out of range")]
fn folded_layer_panics_on_a_token_beyond_its_table() {
    folded_step(StepInput::Tokens(&[11]));
}

#[test]
#[should_panic(expected = "a folded layer reads token ids")]
fn folded_layer_refuses_values() {
    folded_step(StepInput::Values(&[0.0; 2]));
}

#[test]
fn embed_rows_gathers_and_zeroes_no_token() {
    let table: Vec<f32> = (0..12).map(|v| v as f32).collect(); // 4 rows of 3
    let mut out = vec![f32::NAN; 4 * 3];
    embed_rows(&table, 3, &[3, NO_TOKEN, 0, 3], &mut out);
    assert_eq!(out, [9.0, 10.0, 11.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 9.0, 10.0, 11.0]);
    embed_rows(&table, 0, &[7], &mut []);
}

#[test]
#[should_panic(expected = "token id 4 out of range")]
fn embed_rows_panics_on_bad_id() {
    embed_rows(&[0.0; 12], 3, &[4], &mut [0.0; 3]);
}

#[test]
fn project_argmax_matches_reference_and_breaks_ties_low() {
    let pool = pool();
    for &(rows, hidden, vocab) in &[(1, 3, 5), (3, 7, 11), (17, 8, 40), (64, 16, 300)] {
        if cfg!(miri) && rows > 3 {
            continue;
        }
        let w = values(vocab * hidden, 7, 1.0);
        let b = values(vocab, 8, 0.5);
        let h = values(rows * hidden, 9, 1.0);
        let p = Projection::from_torch(&w, &b);
        assert_eq!((p.vocab(), p.hidden()), (vocab, hidden));
        for threads in pool.threads() {
            let mut logits = vec![0.0; rows * vocab];
            let mut out = vec![u32::MAX; rows + 1];
            pool.install(|| project_argmax(&p, &h, rows, &mut logits, &mut out, threads));
            assert_eq!(out[rows], u32::MAX, "only `rows` tokens written");
            for r in 0..rows {
                let l: Vec<f64> = (0..vocab)
                    .map(|v| {
                        b[v] as f64
                            + (0..hidden)
                                .map(|i| w[v * hidden + i] as f64 * h[r * hidden + i] as f64)
                                .sum::<f64>()
                    })
                    .collect();
                let best = (0..vocab).fold(0, |a, v| if l[v] > l[a] { v } else { a });
                // The f32 winner may differ from f64's only on a near-tie.
                let got = out[r] as usize;
                assert!(got == best || (l[best] - l[got]).abs() <= 1e-5, "row {r}: {got} vs {best}");
            }
        }
    }
    // Exact ties: zero weights, equal biases at ids 1, 3 and 4 → 1.
    let p = Projection::from_torch(&[0.0; 10], &[0.0, 2.0, 1.0, 2.0, 2.0]);
    let mut out = [0u32; 2];
    project_argmax(&p, &[1.0, -1.0, 3.0, 4.0], 2, &mut [0.0; 10], &mut out, Threads(1));
    assert_eq!(out, [1, 1]);
    assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 1.0]), 1);
    assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
    assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 0);
    assert_eq!(argmax(&[f32::NAN; 3]), 0);
}

#[test]
fn scratch_reserve_reports_unavailable() {
    let mut s = LstmScratch::new();
    assert_eq!(s.reserve(usize::MAX / 2, 1024, 1024).unwrap_err().code(), Code::Unavailable);
    s.reserve(4, 3, 2).unwrap();
    assert!(s.x.len() >= 20 && s.g.len() >= 32 && s.c.len() >= 8);
}

#[test]
fn step_flops_counts_the_gemm() {
    assert_eq!(step_flops(512, 1024, 1024), 2.0 * 512.0 * 2048.0 * 4096.0);
}
