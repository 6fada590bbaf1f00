//! The layer models' CUDA kernels (`cuda/layers.cu`, and `serve_bias_act`'s GELU and tanh) against
//! the CPU backend on the same inputs (ARCHITECTURE.md §9), on the GPU and on the host
//! (`*_on_host`: the same kernel sources compiled for the CPU, `tests/common/kernels_on_host.rs`):
//!
//! * a ResNet convolution — `serve_chw_to_hwc`, `serve_im2col`, the GEMM with the folded
//!   BatchNorm weight, `serve_bias_act` — against `ConvLayer::forward`, for every geometry the
//!   ResNets use (7×7/2 pad 3, 3×3/1, 3×3/2, 1×1/1, 1×1/2) on odd image sizes, ReLU or not;
//! * `serve_max_pool` (negative values, a NaN), `serve_avg_pool`, `serve_add_relu` against
//!   `conv.rs`;
//! * `serve_layer_norm` (with and without a residual, in place) against `transformer::layer_norm`,
//!   and the GELU and tanh activations against `transformer::gelu` and `f32::tanh`;
//! * `serve_attention` over three requests of different lengths packed back to back against the
//!   textbook attention in f64;
//! * `serve_bert_embed` + `serve_layer_norm` against the CPU's embeddings layer of a BERT.
//!
//! With no CUDA device each GPU test prints `skipped: no CUDA device` and passes, unless
//! `SERVE_REQUIRE_GPU=1`.

mod common;

use common::assert_within as close;
use common::cuda_kernels::{Dev, gpu, host, relu_act};

use rand::{SeedableRng, rngs::StdRng};
use serve::backend::cpu::conv::{ConvLayer, add_relu, chw_to_hwc, global_avg_pool, max_pool_3x3_s2};
use serve::backend::cpu::gemm::Threads;
use serve::backend::cpu::transformer::{BertCpu, BertScratch, gelu, layer_norm};
use serve::backend::cuda::abi;
use serve::model::bert::{Bert, BertConfig, Norm};
use serve::model::resnet::{Conv, Geometry};
use serve::workload::values;

on_gpu_and_host!(check_convolution(true): convolution_matches_the_cpu, convolution_matches_the_cpu_on_host);

fn check_convolution(mut g: Dev) {
    for (in_c, out_c, k, stride, pad, h, w) in [
        (3, 8, 7, 2, 3, 17, 13),
        (6, 5, 3, 1, 1, 9, 7),
        (5, 8, 3, 2, 1, 8, 11),
        (7, 4, 1, 1, 0, 5, 6),
        (6, 9, 1, 2, 0, 9, 7),
    ] {
        let n = 3;
        let cv = Conv::random(
            Geometry { in_c, out_c, k, stride, pad },
            &mut StdRng::seed_from_u64((k * 10 + stride) as u64),
        );
        let x = values(n * in_c * h * w, 5, 1.0);
        let cpu = ConvLayer::new(&cv);
        let mut hwc = vec![0.0; x.len()];
        chw_to_hwc(&x, (n, in_c, h, w), &mut hwc);
        let (oh, ow) = (cv.g.out_side(h), cv.g.out_side(w));
        let rows = n * oh * ow;
        let (wf, bf) = cv.folded();
        let x_d = g.upload(&x).unwrap();
        let hwc_d = g.alloc::<f32>(x.len()).unwrap();
        g.chw_to_hwc(&x_d, (n, in_c, h, w), &hwc_d);
        assert_eq!(g.download(&hwc_d).unwrap(), hwc, "{} chw_to_hwc", g.name());
        let col = g.alloc::<f32>(rows * k * k * in_c).unwrap();
        assert_eq!(g.im2col(&hwc_d, (n, h, w, in_c), (k, stride, pad), &col), (oh, ow));
        let (w_d, b_d) = (g.upload(&wf).unwrap(), g.upload(&bf).unwrap());
        let mut y = g.alloc::<f32>(rows * out_c).unwrap();
        g.gemm((rows, out_c, k * k * in_c), &col, &w_d, &mut y);
        for relu in [false, true] {
            let mut want = vec![f32::NAN; rows * out_c];
            let mut scratch = vec![0.0; n * cv.g.col_len(h, w)];
            cpu.forward(&hwc, (n, h, w), &mut want, &mut scratch, relu, Threads(1));
            let out = g.alloc::<f32>(rows * out_c).unwrap();
            g.bias_act((&y, out_c), Some(&b_d), (&out, out_c), (rows, out_c), relu_act(relu));
            close(
                &g.download(&out).unwrap(),
                &want,
                1e-4,
                &format!("{} conv {k}×{k}/{stride} relu {relu}", g.name()),
            );
        }
    }
}

on_gpu_and_host!(check_pooling(false): pooling_and_residual_match_the_cpu, pooling_and_residual_match_the_cpu_on_host);

fn check_pooling(g: Dev) {
    let (n, h, w, c) = (2, 9, 6, 5);
    let mut x: Vec<f32> = values(n * h * w * c, 8, 3.0).iter().map(|v| v - 2.0).collect();
    x[17] = f32::NAN;
    let x_d = g.upload(&x).unwrap();
    let (oh, ow) = (5, 3);
    let out = g.alloc::<f32>(n * oh * ow * c).unwrap();
    assert_eq!(g.max_pool(&x_d, (n, h, w, c), &out), (oh, ow));
    let mut want = vec![0.0; n * oh * ow * c];
    assert_eq!(max_pool_3x3_s2(&x, (n, h, w, c), &mut want), (oh, ow));
    let got = g.download(&out).unwrap();
    assert!(
        got.iter().zip(&want).all(|(a, b)| a == b || (a.is_nan() && b.is_nan())),
        "{} max pool",
        g.name()
    );
    assert!(got.iter().any(|v| v.is_nan()), "the NaN propagates");

    let y: Vec<f32> = values(n * h * w * c, 9, 1.0);
    let avg = g.alloc::<f32>(n * c).unwrap();
    g.avg_pool(&g.upload(&y).unwrap(), (n, h * w, c), &avg);
    let mut want = vec![0.0; n * c];
    global_avg_pool(&y, (n, h, w, c), &mut want);
    close(&g.download(&avg).unwrap(), &want, 1e-5, &format!("{} average pool", g.name()));

    let (a, b) = (values(1000, 10, 1.0), values(1000, 11, 1.0));
    let (a_d, b_d) = (g.upload(&a).unwrap(), g.upload(&b).unwrap());
    g.add_relu(&a_d, &b_d, &a_d, 1000); // in place
    let mut want = a.clone();
    add_relu(&mut want, &b, Threads(1));
    assert_eq!(g.download(&a_d).unwrap(), want, "{} add + ReLU", g.name());
}

on_gpu_and_host!(check_norm_and_activations(false): layer_norm_and_activations_match_the_cpu, layer_norm_and_activations_match_the_cpu_on_host);

fn check_norm_and_activations(g: Dev) {
    for (rows, cols) in [(1, 7), (5, 32), (3, 300), (2, 768)] {
        let x = values(rows * cols, cols as u64, 2.0);
        let r = values(rows * cols, cols as u64 + 1, 1.0);
        let norm = Norm {
            weight: values(cols, 3, 0.5).iter().map(|v| v + 1.0).collect(),
            bias: values(cols, 4, 0.3),
        };
        let eps = 1e-12;
        let (gamma, beta) = (g.upload(&norm.weight).unwrap(), g.upload(&norm.bias).unwrap());
        for residual in [false, true] {
            let mut want = x.clone();
            if residual {
                want.iter_mut().zip(&r).for_each(|(a, b)| *a += b);
            }
            for row in want.chunks_exact_mut(cols) {
                layer_norm(row, &norm, eps);
            }
            let x_d = g.upload(&x).unwrap();
            let r_d = g.upload(&r).unwrap();
            // In place: dst is x.
            g.layer_norm(&x_d, residual.then_some(&r_d), (&gamma, &beta), &x_d, (rows, cols), eps);
            close(
                &g.download(&x_d).unwrap(),
                &want,
                1e-5,
                &format!("{} layer norm {rows}×{cols}, residual {residual}", g.name()),
            );
        }
    }
    let v: Vec<f32> = values(4096, 12, 6.0);
    let bias = values(64, 13, 0.5);
    let (v_d, b_d) = (g.upload(&v).unwrap(), g.upload(&bias).unwrap());
    for (act, f) in [(abi::SERVE_ACT_GELU, gelu as fn(f32) -> f32), (abi::SERVE_ACT_TANH, f32::tanh)] {
        let out = g.alloc::<f32>(4096).unwrap();
        g.bias_act((&v_d, 64), Some(&b_d), (&out, 64), (64, 64), act);
        let want: Vec<f32> = v.iter().enumerate().map(|(i, &x)| f(x + bias[i % 64])).collect();
        close(&g.download(&out).unwrap(), &want, 2e-6, &format!("{} activation {act}", g.name()));
    }
}

on_gpu_and_host!(check_attention(false): attention_matches_the_textbook_one, attention_matches_the_textbook_one_on_host);

fn check_attention(g: Dev) {
    let (heads, d) = (4, 8);
    let h = heads * d;
    let lens = [3usize, 7, 1, 12];
    let tokens: usize = lens.iter().sum();
    let max_len = 12;
    let qkv = values(tokens * 3 * h, 21, 1.5);
    let mut spans = Vec::new();
    let mut start = 0;
    for &l in &lens {
        for _ in 0..l {
            spans.extend([start as u32, l as u32]);
        }
        start += l;
    }
    // The textbook: per token and head, softmax(q·kᵀ/√d)·v over its request, in f64.
    let mut want = vec![0.0f32; tokens * h];
    for t in 0..tokens {
        let (s0, len) = (spans[2 * t] as usize, spans[2 * t + 1] as usize);
        for hd in 0..heads {
            let q = &qkv[t * 3 * h + hd * d..][..d];
            let scores: Vec<f64> = (0..len)
                .map(|j| {
                    let k = &qkv[(s0 + j) * 3 * h + h + hd * d..][..d];
                    q.iter().zip(k).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for x in 0..d {
                let acc: f64 = (0..len)
                    .map(|j| e[j] / sum * f64::from(qkv[(s0 + j) * 3 * h + 2 * h + hd * d + x]))
                    .sum();
                want[t * h + hd * d + x] = acc as f32;
            }
        }
    }
    let (qkv_d, spans_d) = (g.upload(&qkv).unwrap(), g.upload(&spans).unwrap());
    let scores = g.alloc::<f32>(tokens * heads * max_len).unwrap();
    let ctx = g.alloc::<f32>(tokens * h).unwrap();
    g.attention(&qkv_d, &spans_d, (tokens, heads, d, max_len), &scores, &ctx);
    close(&g.download(&ctx).unwrap(), &want, 1e-5, &format!("{} attention", g.name()));
}

on_gpu_and_host!(check_bert_embedding(false): bert_embeddings_match_the_cpu, bert_embeddings_match_the_cpu_on_host);

fn check_bert_embedding(g: Dev) {
    let cfg = BertConfig {
        name: None,
        vocab: 60,
        hidden: 24,
        layers: 1,
        heads: 4,
        intermediate: 32,
        max_position: 20,
        type_vocab: 2,
        seq_len: 9,
        layer_norm_eps: Some(1e-5),
    };
    let bert = Bert::random(&cfg, 7);
    let cpu = BertCpu::new(&bert);
    let lens = [4usize, 9, 1];
    let mut rows = vec![-1.0f32; lens.len() * cfg.seq_len];
    let (mut ids, mut positions) = (Vec::new(), Vec::new());
    for (r, &l) in lens.iter().enumerate() {
        for p in 0..l {
            let id = ((r * 17 + p * 5) % cfg.vocab) as u32;
            rows[r * cfg.seq_len + p] = id as f32;
            ids.push(id);
            positions.push(p as u32);
        }
    }
    let row_len = cfg.seq_len * cfg.hidden + 1;
    let mut want = vec![0.0; lens.len() * row_len];
    cpu.run((0, 1), lens.len(), &rows, &mut want, &mut BertScratch::default(), Threads(1)).unwrap();
    let tokens = ids.len();
    let h = cfg.hidden;
    let x = g.alloc::<f32>(tokens * h).unwrap();
    g.bert_embed(
        (&g.upload(&ids).unwrap(), &g.upload(&positions).unwrap()),
        (
            &g.upload(&bert.word).unwrap(),
            &g.upload(&bert.position).unwrap(),
            &g.upload(&bert.token_type[..h]).unwrap(),
        ),
        &x,
        (tokens, h, cfg.vocab, cfg.max_position),
    );
    let (gamma, beta) =
        (g.upload(&bert.embed_norm.weight).unwrap(), g.upload(&bert.embed_norm.bias).unwrap());
    g.layer_norm(&x, None, (&gamma, &beta), &x, (tokens, h), cfg.eps());
    let got = g.download(&x).unwrap();
    let mut t = 0;
    for (r, &l) in lens.iter().enumerate() {
        close(
            &got[t * h..(t + l) * h],
            &want[r * row_len..r * row_len + l * h],
            1e-5,
            &format!("{} embeddings of request {r}", g.name()),
        );
        t += l;
    }
}
