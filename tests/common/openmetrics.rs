//! A strict reader of the OpenMetrics text format (what `Runtime::metrics_text` and
//! `serve_runtime_metrics` produce), for the tests: it checks the structure a Prometheus scraper
//! relies on and returns the samples.

use std::collections::{BTreeMap, HashMap};

/// A sample's labels, sorted by name.
pub type Labels = BTreeMap<String, String>;

#[derive(Debug, Default)]
pub struct Exposition {
    /// Family name → its type (`counter`, `gauge`, `histogram`, …).
    pub types: HashMap<String, String>,
    /// (sample name, labels) → value.
    pub samples: HashMap<(String, Labels), f64>,
}

impl Exposition {
    /// Parse `text`, panicking with the line on any violation: every family has `# HELP` and
    /// `# TYPE` before its samples, each sample's name is its family's name or the family's name
    /// with the suffix its type allows, label values are quoted, values are numbers, no sample
    /// appears twice, and the text ends with `# EOF`.
    pub fn parse(text: &str) -> Exposition {
        let mut e = Exposition::default();
        let mut family: Option<(String, String)> = None;
        let mut eof = false;
        for (n, line) in text.lines().enumerate() {
            let at = || format!("line {}: {line:?}", n + 1);
            assert!(!eof, "text after # EOF at {}", at());
            if line == "# EOF" {
                eof = true;
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap();
                assert!(!e.types.contains_key(name), "family {name} described twice at {}", at());
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, ty) = rest.split_once(' ').unwrap_or_else(|| panic!("bad TYPE at {}", at()));
                assert!(
                    ["counter", "gauge", "histogram", "summary", "info", "stateset", "unknown"].contains(&ty),
                    "unknown type at {}",
                    at()
                );
                e.types.insert(name.to_string(), ty.to_string());
                family = Some((name.to_string(), ty.to_string()));
                continue;
            }
            assert!(!line.starts_with('#'), "unknown comment at {}", at());
            let (fam, ty) = family.as_ref().unwrap_or_else(|| panic!("sample before any TYPE at {}", at()));
            let (name, labels, value) =
                sample(line).unwrap_or_else(|| panic!("malformed sample at {}", at()));
            let suffixes: &[&str] = match ty.as_str() {
                "counter" => &["_total", "_created"],
                "histogram" => &["_bucket", "_count", "_sum", "_created"],
                _ => &[""],
            };
            assert!(
                suffixes.iter().any(|s| name == format!("{fam}{s}")),
                "sample {name} does not belong to family {fam} ({ty}) at {}",
                at()
            );
            let key = (name, labels);
            assert!(e.samples.insert(key, value).is_none(), "duplicate sample at {}", at());
        }
        assert!(eof, "the text does not end with # EOF");
        e
    }

    /// The value of `name` with exactly `labels`.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.samples.get(&(name.to_string(), labels)).copied()
    }

    /// Samples of `name` whose labels include `with`.
    pub fn matching(&self, name: &str, with: &[(&str, &str)]) -> Vec<(&Labels, f64)> {
        self.samples
            .iter()
            .filter(|((n, l), _)| {
                n == name && with.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|((_, l), v)| (l, *v))
            .collect()
    }

    /// Every label value of `label` any sample has.
    pub fn label_values(&self, label: &str) -> Vec<String> {
        let mut v: Vec<String> = self.samples.keys().filter_map(|(_, l)| l.get(label).cloned()).collect();
        v.sort();
        v.dedup();
        v
    }

    /// Check a histogram's series with `labels` (cumulative buckets that never decrease, a
    /// `+Inf` bucket equal to `_count`) and return (count, sum).
    pub fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> (u64, f64) {
        let count =
            self.get(&format!("{name}_count"), labels).unwrap_or_else(|| panic!("{name}_count {labels:?}"));
        let sum = self.get(&format!("{name}_sum"), labels).unwrap();
        let mut buckets: Vec<(f64, f64)> = self
            .matching(&format!("{name}_bucket"), labels)
            .into_iter()
            .filter(|(l, _)| l.len() == labels.len() + 1)
            .map(|(l, v)| {
                let le = &l["le"];
                (if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap() }, v)
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(buckets.len() >= 2, "{name} {labels:?} has {} buckets", buckets.len());
        assert!(
            buckets.windows(2).all(|w| w[0].1 <= w[1].1),
            "{name} {labels:?}: buckets decrease: {buckets:?}"
        );
        let last = buckets.last().unwrap();
        assert!(
            last.0.is_infinite() && last.1 == count,
            "{name} {labels:?}: +Inf bucket {last:?} vs count {count}"
        );
        (count as u64, sum)
    }
}

/// `name{k="v",…} value` (labels optional).
fn sample(line: &str) -> Option<(String, Labels, f64)> {
    let (head, value) = line.rsplit_once(' ')?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    let (name, labels) = match head.split_once('{') {
        None => (head, Labels::new()),
        Some((name, rest)) => {
            let body = rest.strip_suffix('}')?;
            let mut labels = Labels::new();
            for pair in body.split(',').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=')?;
                let v = v.strip_prefix('"')?.strip_suffix('"')?;
                if labels.insert(k.to_string(), v.to_string()).is_some() {
                    return None;
                }
            }
            (name, labels)
        }
    };
    let valid_name =
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    valid_name.then(|| (name.to_string(), labels, value))
}
