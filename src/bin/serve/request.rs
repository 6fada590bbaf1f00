//! The JSON of `serve infer`: one request line in (`{"input":[…]}`, `{"tokens":[…]}`,
//! `{"tokens":[…],"parents":[…]}`), one result or error line out.
//!
//! Requests are parsed straight into their typed arrays (no `serde_json::Value` tree, which costs
//! ~20× the line's bytes), so memory stays proportional to the line. Non-finite output elements are
//! written as the strings `"NaN"`, `"Infinity"`, `"-Infinity"` (as TF-Serving's REST API does), so
//! every line stays strict JSON and no result is ever `null`.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeSeq, Serializer};
use serde_json::json;

use serve::{Code, Input};

pub(crate) fn error_line(code: Code, message: &str) -> String {
    json!({"error": {"code": code.name(), "message": message}}).to_string()
}

/// A successful result line. Serialized straight from the `f32`s (not through `Value`, which
/// would widen them to `f64` and print digits the model never computed).
#[derive(serde::Serialize)]
pub(crate) enum ResultLine<'a> {
    #[serde(rename = "output")]
    F32(F32s<'a>),
    #[serde(rename = "tokens")]
    Tokens(&'a [u32]),
}

/// f32s as JSON numbers, the non-finite ones as `"NaN"`, `"Infinity"`, `"-Infinity"`.
pub(crate) struct F32s<'a>(pub(crate) &'a [f32]);

impl serde::Serialize for F32s<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for &x in self.0 {
            if x.is_finite() {
                seq.serialize_element(&x)?;
            } else if x.is_nan() {
                seq.serialize_element("NaN")?;
            } else if x > 0.0 {
                seq.serialize_element("Infinity")?;
            } else {
                seq.serialize_element("-Infinity")?;
            }
        }
        seq.end()
    }
}

/// Parse one request line. The error says what is wrong and where within the line (the caller
/// adds the line number).
pub(crate) fn parse_request(bytes: &[u8]) -> Result<Input, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not valid UTF-8 ({e})"))?;
    if text.trim().is_empty() {
        return Err("empty line; expected a JSON object such as {\"input\":[…]} or {\"tokens\":[…]}".into());
    }
    let fields: Fields = serde_json::from_str(text).map_err(|e| {
        let full = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        let bare = full.strip_suffix(&suffix).unwrap_or(&full);
        match e.classify() {
            // Our own messages (wrong type, unknown key, bad element): already precise.
            serde_json::error::Category::Data => bare.to_string(),
            _ => format!("malformed JSON at column {}: {bare}", e.column()),
        }
    })?;
    match fields {
        Fields { input: Some(_), tokens: Some(_), .. } => {
            Err("a request has `input` or `tokens`, not both".into())
        }
        Fields { input: Some(_), parents: Some(_), .. } => {
            Err("`parents` goes with `tokens`, not with `input`".into())
        }
        Fields { input: Some(x), .. } => Ok(Input::F32(x)),
        Fields { tokens: Some(tokens), parents: None, .. } => Ok(Input::Tokens(tokens)),
        Fields { tokens: Some(tokens), parents: Some(parents), .. } => {
            if tokens.len() != parents.len() {
                return Err(format!(
                    "`tokens` has {} entries but `parents` has {}; a tree needs one parent per node",
                    tokens.len(),
                    parents.len()
                ));
            }
            Ok(Input::Tree { tokens, parents })
        }
        Fields { parents: Some(_), .. } => {
            Err("missing key `tokens` (`parents` needs the tree's `tokens`)".into())
        }
        _ => Err("missing key: a request has `input` (mlp) or `tokens` (lstm, seq2seq, treelstm)".into()),
    }
}

/// The keys of a request object, each parsed into its typed array as it is read.
#[derive(Default)]
struct Fields {
    input: Option<Vec<f32>>,
    tokens: Option<Vec<u32>>,
    parents: Option<Vec<i32>>,
}

impl<'de> serde::Deserialize<'de> for Fields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Fields, D::Error> {
        d.deserialize_any(FieldsVisitor)
    }
}

struct FieldsVisitor;

impl<'de> Visitor<'de> for FieldsVisitor {
    type Value = Fields;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields, A::Error> {
        let mut f = Fields::default();
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            let dup = || de::Error::custom(format!("duplicate key `{key}`"));
            match &*key {
                "input" if f.input.is_some() => return Err(dup()),
                "tokens" if f.tokens.is_some() => return Err(dup()),
                "parents" if f.parents.is_some() => return Err(dup()),
                "input" => f.input = Some(map.next_value_seed(Array::<F32Elem>::new("input", "numbers"))?),
                "tokens" => {
                    f.tokens = Some(map.next_value_seed(Array::<TokenElem>::new("tokens", "token ids"))?)
                }
                "parents" => {
                    f.parents =
                        Some(map.next_value_seed(Array::<ParentElem>::new("parents", "parent indices"))?)
                }
                other => {
                    return Err(de::Error::custom(format!(
                        "unknown key `{other}` (a request has `input`, or `tokens` and optionally `parents`)"
                    )));
                }
            }
        }
        Ok(f)
    }

    // Anything but an object.
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Fields, E> {
        Err(not_an_object("a boolean"))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Fields, E> {
        Err(not_an_object("a number"))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Fields, E> {
        Err(not_an_object("a number"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Fields, E> {
        Err(not_an_object("a number"))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Fields, E> {
        Err(not_an_object("a string"))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Fields, E> {
        Err(not_an_object("null"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Fields, A::Error> {
        Err(not_an_object("an array"))
    }
}

fn not_an_object<E: de::Error>(found: &str) -> E {
    E::custom(format!("expected a JSON object, found {found}"))
}

/// One JSON value where an array element is expected: a number, or what else it is.
#[derive(Clone, Copy)]
enum Scalar {
    U(u64),
    I(i64),
    F(f64),
    Other(&'static str),
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::U(v) => write!(f, "{v}"),
            Scalar::I(v) => write!(f, "{v}"),
            // Debug: the shortest text that reads back (1.5, 1e39).
            Scalar::F(v) => write!(f, "{v:?}"),
            Scalar::Other(what) => f.write_str(what),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Scalar, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
        Ok(Scalar::U(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
        Ok(Scalar::I(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Scalar, E> {
        Ok(Scalar::F(v))
    }
    fn visit_bool<E>(self, _: bool) -> Result<Scalar, E> {
        Ok(Scalar::Other("a boolean"))
    }
    fn visit_str<E>(self, _: &str) -> Result<Scalar, E> {
        Ok(Scalar::Other("a string"))
    }
    fn visit_unit<E>(self) -> Result<Scalar, E> {
        Ok(Scalar::Other("null"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other("an array"))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other("an object"))
    }
}

/// How one array's elements are checked: `Err` is the message after "`key[j]` ".
trait Elem {
    type T;
    fn convert(x: Scalar) -> Result<Self::T, String>;
}

struct F32Elem;
impl Elem for F32Elem {
    type T = f32;
    fn convert(x: Scalar) -> Result<f32, String> {
        let f = match x {
            Scalar::U(v) => v as f64,
            Scalar::I(v) => v as f64,
            Scalar::F(v) => v,
            Scalar::Other(what) => return Err(format!("is {what}, expected a number")),
        };
        if (f as f32).is_finite() { Ok(f as f32) } else { Err(format!("= {x} is outside the f32 range")) }
    }
}

struct TokenElem;
impl Elem for TokenElem {
    type T = u32;
    fn convert(x: Scalar) -> Result<u32, String> {
        match x {
            Scalar::U(v) if v <= u64::from(u32::MAX) => Ok(v as u32),
            Scalar::Other(what) => Err(format!("is {what}, expected an integer token id")),
            n => Err(format!("= {n} is not a token id (an integer in 0..={})", u32::MAX)),
        }
    }
}

struct ParentElem;
impl Elem for ParentElem {
    type T = i32;
    fn convert(x: Scalar) -> Result<i32, String> {
        let bad = |n: &Scalar| format!("= {n} is not a parent index (-1 for the root, else a node index)");
        match x {
            Scalar::U(v) => i32::try_from(v).map_err(|_| bad(&x)),
            // (serde_json gives non-negative integers as `U`: `I` is always negative.)
            Scalar::I(-1) => Ok(-1),
            Scalar::Other(what) => Err(format!("is {what}, expected an integer parent index")),
            n => Err(bad(&n)),
        }
    }
}

/// The array under `key`, its elements converted by `E` as they are read.
struct Array<E> {
    key: &'static str,
    what: &'static str,
    elem: std::marker::PhantomData<E>,
}

impl<E> Array<E> {
    fn new(key: &'static str, what: &'static str) -> Array<E> {
        Array { key, what, elem: std::marker::PhantomData }
    }

    fn not_an_array<Er: de::Error>(&self, found: &str) -> Er {
        Er::custom(format!("`{}` must be an array of {}, found {found}", self.key, self.what))
    }
}

impl<'de, E: Elem> DeserializeSeed<'de> for Array<E> {
    type Value = Vec<E::T>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<E::T>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, E: Elem> Visitor<'de> for Array<E> {
    type Value = Vec<E::T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an array of {}", self.what)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<E::T>, A::Error> {
        let mut out = Vec::new();
        while let Some(x) = seq.next_element::<Scalar>()? {
            let j = out.len();
            out.push(E::convert(x).map_err(|m| de::Error::custom(format!("`{}[{j}]` {m}", self.key)))?);
        }
        Ok(out)
    }
    fn visit_bool<Er: de::Error>(self, _: bool) -> Result<Vec<E::T>, Er> {
        Err(self.not_an_array("a boolean"))
    }
    fn visit_i64<Er: de::Error>(self, _: i64) -> Result<Vec<E::T>, Er> {
        Err(self.not_an_array("a number"))
    }
    fn visit_u64<Er: de::Error>(self, _: u64) -> Result<Vec<E::T>, Er> {
        Err(self.not_an_array("a number"))
    }
    fn visit_f64<Er: de::Error>(self, _: f64) -> Result<Vec<E::T>, Er> {
        Err(self.not_an_array("a number"))
    }
    fn visit_str<Er: de::Error>(self, _: &str) -> Result<Vec<E::T>, Er> {
        Err(self.not_an_array("a string"))
    }
    fn visit_unit<Er: de::Error>(self) -> Result<Vec<E::T>, Er> {
        Err(self.not_an_array("null"))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Vec<E::T>, A::Error> {
        Err(self.not_an_array("an object"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Input, String> {
        parse_request(s.as_bytes())
    }

    #[test]
    fn parses_the_three_request_shapes() {
        assert_eq!(parse(r#"{"input":[1, 2.5, -3e2]}"#), Ok(Input::F32(vec![1.0, 2.5, -300.0])));
        assert_eq!(parse(r#"{"tokens":[0, 4294967295]}"#), Ok(Input::Tokens(vec![0, u32::MAX])));
        assert_eq!(
            parse(r#" {"parents":[-1,0], "tokens":[5,6]} "#),
            Ok(Input::Tree { tokens: vec![5, 6], parents: vec![-1, 0] })
        );
        assert_eq!(parse(r#"{"input":[-0.0, 1e-45]}"#), Ok(Input::F32(vec![-0.0, 1e-45])));
    }

    #[test]
    fn rejects_bad_lines_saying_where() {
        let err = |s: &str| parse(s).unwrap_err();
        assert!(err(r#"{"tokens":[1, 1.5]}"#).contains("`tokens[1]` = 1.5"));
        assert!(err(r#"{"tokens":[-1]}"#).contains("`tokens[0]` = -1"));
        assert!(err(r#"{"tokens":[4294967296]}"#).contains("`tokens[0]` = 4294967296"));
        assert!(err(r#"{"tokens":["a"]}"#).contains("`tokens[0]` is a string"));
        assert!(err(r#"{"tokens":[[1]]}"#).contains("`tokens[0]` is an array"));
        assert!(err(r#"{"tokens":[1],"parents":["x"]}"#).contains("`parents[0]` is a string"));
        assert!(err(r#"{"tokens":[1],"parents":[-2]}"#).contains("`parents[0]` = -2"));
        assert!(err(r#"{"tokens":[1],"parents":[2147483648]}"#).contains("`parents[0]` = 2147483648"));
        assert!(err(r#"{"tokens":[1,2],"parents":[-1]}"#).contains("one parent per node"));
        assert!(err(r#"{"tokens":[1],"parents":{}}"#).contains("`parents` must be an array"));
        assert!(err(r#"{"input":[1e39]}"#).contains("`input[0]` = 1e39 is outside the f32 range"));
        assert!(err(r#"{"input":[null]}"#).contains("`input[0]` is null"));
        assert!(err(r#"{"input":[1], "tokens":[1]}"#).contains("not both"));
        assert!(err(r#"{"input":[1], "input":[2]}"#).contains("duplicate key `input`"));
        assert!(err(r#"{"inputs":[1]}"#).contains("unknown key `inputs`"));
        assert!(err("{}").contains("missing key"));
        assert!(err("[1,2]").contains("expected a JSON object, found an array"));
        assert!(err("").contains("empty line"));
        let m = err(r#"{"input": [1, 2"#);
        assert!(m.starts_with("malformed JSON at column"), "{m}");
        assert!(!m.contains("at line"), "{m}");
        let m = err(r#"{"input": "x"}"#);
        assert_eq!(m, "`input` must be an array of numbers, found a string");
        assert!(parse_request(b"{\"input\":[1]}\xff").unwrap_err().contains("UTF-8"));
    }

    #[test]
    fn non_finite_outputs_are_strings_never_null() {
        let out = [1.5, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0];
        let line = serde_json::to_string(&ResultLine::F32(F32s(&out))).unwrap();
        assert_eq!(line, r#"{"output":[1.5,"NaN","Infinity","-Infinity",-0.0]}"#);
    }
}
