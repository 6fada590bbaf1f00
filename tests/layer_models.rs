//! The layer models `resnet` and `bert` (ARCHITECTURE.md §6) against PyTorch: the fixtures under
//! `ffi_examples/testdata/` (`resnet_small`, `resnet_bottleneck_small`, `bert_small`) were made
//! by `scripts/make_layer_fixtures.py` from torchvision's ResNet and transformers' `BertModel`
//! (random init, BatchNorm statistics and LayerNorm parameters randomised, saved with
//! `safetensors.torch.save_file(model.state_dict())`, integer buffers included); their
//! `expected.json` holds PyTorch's fp32 outputs. The runtime serves them on the CPU backend
//! under timeout batching and must match within 1e-4 relative; and every bad model directory or
//! request is refused naming what is wrong.

mod common;

use std::path::{Path, PathBuf};

use common::layer_fixtures::{assert_close, fixture, requests, serve_layer_fixtures};
use serve::model::weights::{Tensor, Weights, write_safetensors};
use serve::{BackendChoice, Code, Input, ModelOptions, Output, Runtime, SubmitOptions};

fn runtime() -> Runtime {
    Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(2).build().unwrap()
}

/// Every request of every fixture, served in batches of up to 4 and alone, matches PyTorch.
#[test]
fn resnet_and_bert_fixtures_match_pytorch() {
    serve_layer_fixtures(&runtime(), "the CPU");
}

/// A copy of fixture `name` in a fresh directory, for the bad-model cases to edit.
fn copy_fixture(name: &str, label: &str) -> PathBuf {
    let dir = common::tempdir(label);
    for f in ["model.toml", "weights.safetensors"] {
        std::fs::copy(fixture(name).join(f), dir.join(f)).unwrap();
    }
    dir
}

fn load_err(dir: &Path) -> serve::Error {
    serve::model::load(dir).err().unwrap_or_else(|| panic!("{} should not load", dir.display()))
}

/// Rewrite the fixture's weights through `edit` (the tensors by name).
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    let mut w = Weights::load(&dir.join("weights.safetensors")).unwrap();
    let mut tensors: Vec<(String, Tensor)> =
        w.names().into_iter().map(|n| (n.clone(), w.take_any(&n).unwrap())).collect();
    edit(&mut tensors);
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_safetensors(&dir.join("weights.safetensors"), &refs).unwrap();
}

fn set_key(dir: &Path, key: &str, value: &str) {
    let p = dir.join("model.toml");
    let text = std::fs::read_to_string(&p).unwrap();
    let mut found = false;
    let mut out: Vec<String> = text
        .lines()
        .map(|l| {
            if l.split('=').next().map(str::trim) == Some(key) {
                found = true;
                format!("{key} = {value}")
            } else {
                l.to_string()
            }
        })
        .collect();
    if !found {
        out.push(format!("{key} = {value}"));
    }
    std::fs::write(p, out.join("\n") + "\n").unwrap();
}

/// A change made to a copied fixture directory.
type Edit = Box<dyn Fn(&Path)>;

#[test]
fn bad_layer_model_directories_are_format_errors_naming_the_problem() {
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "resnet_small",
            Box::new(|d| edit_weights(d, |t| t.retain(|(n, _)| n != "layer2.0.bn1.running_var"))),
            "missing tensor `layer2.0.bn1.running_var`",
        ),
        (
            "resnet_small",
            Box::new(|d| {
                edit_weights(d, |t| {
                    let (_, w) = t.iter_mut().find(|(n, _)| n == "conv1.weight").unwrap();
                    *w = Tensor::new(vec![4, 3, 5, 5], vec![0.1; 300]);
                })
            }),
            "tensor `conv1.weight` has shape [4, 3, 5, 5], expected [4, 3, 7, 7]",
        ),
        (
            "resnet_small",
            Box::new(|d| set_key(d, "layers", "[1, 1, 1, 2]")),
            "missing tensor `layer4.1.conv1.weight`",
        ),
        ("resnet_small", Box::new(|d| set_key(d, "layers", "[1, 1, 1, 0]")), "layers[3] must be at least 1"),
        ("resnet_small", Box::new(|d| set_key(d, "block", "\"wide\"")), "block = \"wide\""),
        ("resnet_small", Box::new(|d| set_key(d, "image", "[3, 100000, 4]")), "image[1]"),
        (
            "resnet_small",
            Box::new(|d| set_key(d, "num_classes", "11")),
            "tensor `fc.weight` has shape [10, 32], expected [11, 32]",
        ),
        ("resnet_small", Box::new(|d| set_key(d, "depth", "50")), "depth"),
        (
            "resnet_small",
            Box::new(|d| {
                edit_weights(d, |t| {
                    let (_, v) = t.iter_mut().find(|(n, _)| n == "bn1.running_var").unwrap();
                    v.data[2] = -1.0;
                })
            }),
            "`bn1.running_var` element 2 is negative",
        ),
        (
            "bert_small",
            Box::new(|d| set_key(d, "layers", "3")),
            "missing tensor `encoder.layer.2.attention.self.query.weight`",
        ),
        ("bert_small", Box::new(|d| set_key(d, "layers", "1")), "model.toml says layers = 1"),
        ("bert_small", Box::new(|d| set_key(d, "heads", "5")), "not a multiple of heads"),
        ("bert_small", Box::new(|d| set_key(d, "seq_len", "41")), "longer than max_position"),
        ("bert_small", Box::new(|d| set_key(d, "layer_norm_eps", "-1.0")), "layer_norm_eps"),
        (
            "bert_small",
            Box::new(|d| {
                edit_weights(d, |t| {
                    t.push(("encoder.extra.weight".into(), Tensor::new(vec![2], vec![1.0, 2.0])))
                })
            }),
            "unexpected tensor `encoder.extra.weight`",
        ),
        (
            "bert_small",
            Box::new(|d| {
                edit_weights(d, |t| {
                    let (_, w) =
                        t.iter_mut().find(|(n, _)| n == "encoder.layer.1.intermediate.dense.weight").unwrap();
                    *w = Tensor::new(vec![64, 31], vec![0.0; 64 * 31]);
                })
            }),
            "tensor `encoder.layer.1.intermediate.dense.weight` has shape [64, 31], expected [64, 32]",
        ),
    ];
    for (k, (name, edit, want)) in cases.iter().enumerate() {
        let dir = copy_fixture(name, &format!("bad-layer-model-{k}"));
        edit(&dir);
        let e = load_err(&dir);
        assert_eq!(e.code(), Code::Format, "case {k} ({want}): {e}");
        assert!(e.message().contains(want), "case {k}: `{}` should say `{want}`", e.message());
    }
}

/// Integer buffers PyTorch saves are ignored by name (the fixtures hold `num_batches_tracked` and
/// `position_ids`); an integer tensor of another name is FORMAT naming it.
#[test]
fn integer_buffers_are_ignored_only_by_their_names() {
    let dir = copy_fixture("resnet_small", "int-buffer");
    let raw = std::fs::read(dir.join("weights.safetensors")).unwrap();
    assert!(
        String::from_utf8_lossy(&raw[..4096.min(raw.len())]).contains("num_batches_tracked"),
        "the fixture keeps PyTorch's buffers"
    );
    // Rename one I64 buffer in the header (same length, so the offsets stay valid).
    let text = String::from_utf8_lossy(&raw).into_owned();
    let renamed = text.replacen("layer1.0.bn1.num_batches_tracked", "layer1.0.bn1.num_batches_trackeX", 1);
    assert_ne!(renamed, text);
    let mut bytes = raw.clone();
    let at = text.find("layer1.0.bn1.num_batches_tracked").unwrap();
    bytes[at + "layer1.0.bn1.num_batches_tracke".len()] = b'X';
    std::fs::write(dir.join("weights.safetensors"), &bytes).unwrap();
    let e = load_err(&dir);
    assert_eq!(e.code(), Code::Format, "{e}");
    assert!(e.message().contains("tensor `layer1.0.bn1.num_batches_trackeX` has dtype I64"), "{e}");
}

#[test]
fn bad_requests_are_refused_naming_the_problem_and_the_model_keeps_serving() {
    let rt = runtime();
    let resnet = rt.load_model(fixture("resnet_small"), ModelOptions::default()).unwrap();
    let bert = rt.load_model(fixture("bert_small"), ModelOptions::default()).unwrap();
    let cases: Vec<(&serve::Model, Input, &str)> = vec![
        (
            &resnet,
            Input::F32(vec![0.5; 100]),
            "input has length 100; this resnet takes an image of [3, 32, 40] (C × H × W) = 3840 values",
        ),
        (&resnet, Input::F32(vec![]), "input has length 0"),
        (&resnet, Input::Tokens(vec![1, 2]), "an f32 image of 3840 values"),
        (
            &resnet,
            Input::F32({
                let mut v = vec![0.0; 3840];
                v[77] = f32::NAN;
                v
            }),
            "input element 77 is NaN",
        ),
        (&bert, Input::Tokens(vec![3, 100, 4]), "100"),
        (&bert, Input::Tokens(vec![1; 17]), "17"),
        (&bert, Input::Tokens(vec![]), "empty"),
        (&bert, Input::F32(vec![1.0; 16]), "a token sequence"),
    ];
    for (model, input, want) in cases {
        let e = model.submit(input, SubmitOptions::default()).err().expect("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains(want), "`{}` should say `{want}`", e.message());
    }
    // Both still serve.
    for (model, name) in [(&resnet, "resnet_small"), (&bert, "bert_small")] {
        let (x, want) = requests(&fixture(name)).remove(0);
        let Output::F32(got) = model.submit(x, SubmitOptions::default()).unwrap().wait().unwrap() else {
            panic!()
        };
        assert_close(&got, &want, 1e-4, name);
    }
}

/// Random resnets (both block kinds, a non-default width) and a random bert saved as model
/// directories load back identical, their layers listed as the models define them.
#[test]
fn saved_layer_models_load_back_identically() {
    use serve::model::Network;
    use serve::model::bert::{Bert, BertConfig};
    use serve::model::resnet::{ResNet, ResNetConfig};
    let resnet = |block: &str, layers| {
        Network::ResNet(ResNet::random(
            &ResNetConfig {
                name: None,
                block: block.into(),
                layers,
                num_classes: 3,
                image: [2, 9, 11],
                width: Some(4),
            },
            9,
        ))
    };
    let bert = Network::Bert(Bert::random(
        &BertConfig {
            name: None,
            vocab: 30,
            hidden: 8,
            layers: 2,
            heads: 2,
            intermediate: 12,
            max_position: 10,
            type_vocab: 2,
            seq_len: 6,
            layer_norm_eps: Some(1e-5),
        },
        3,
    ));
    for (k, net) in
        [resnet("basic", [2, 1, 1, 1]), resnet("bottleneck", [1, 1, 2, 1]), bert].into_iter().enumerate()
    {
        let dir = common::tempdir(&format!("layer-save-{k}"));
        net.save(&dir).unwrap();
        let back = serve::model::load(&dir).unwrap_or_else(|e| panic!("{}: {e}", net.kind()));
        assert_eq!(back, net, "{} round trip", net.kind());
        let names: Vec<String> = back.layers().iter().map(|l| l.name.clone()).collect();
        match &net {
            Network::ResNet(_) => assert_eq!(names.first().map(String::as_str), Some("stem")),
            _ => assert_eq!(names.first().map(String::as_str), Some("embeddings")),
        }
    }
}

/// A resnet whose logits outnumber every activation (a tiny image, many classes) serves whole
/// batches: the buffers hold the head's output too.
#[test]
fn a_resnet_with_more_classes_than_activations_serves() {
    use serve::model::Network;
    use serve::model::resnet::{ResNet, ResNetConfig};
    let cfg = ResNetConfig {
        name: None,
        block: "basic".into(),
        layers: [1, 1, 1, 1],
        num_classes: 5000,
        image: [3, 6, 5],
        width: Some(4),
    };
    let rt = runtime();
    let model = rt
        .add_network(
            std::sync::Arc::new(Network::ResNet(ResNet::random(&cfg, 4))),
            "wide".into(),
            Default::default(),
        )
        .unwrap();
    let tickets: Vec<_> = (0..6)
        .map(|k| model.submit(Input::F32(vec![k as f32 * 0.1; 90]), SubmitOptions::default()).unwrap())
        .collect();
    for t in tickets {
        let Output::F32(y) = t.wait().unwrap() else { panic!("logits") };
        assert_eq!(y.len(), 5000);
        assert!(y.iter().all(|v| v.is_finite()));
    }
}
