//! One `serve infer` input line through the request parser (`src/bin/serve/request.rs`, included
//! as it is: the CLI's own code), and any f32s it yields back out through the result writer.
//!
//! Checked: parsing never panics and its memory stays proportional to the line (libFuzzer's
//! malloc limit); an error says something; a parsed tree has one parent per token; a result line
//! written from any f32s (NaN and infinities included) is strict JSON that reads back to the same
//! finite values, with `null` nowhere.

#![no_main]

use libfuzzer_sys::fuzz_target;
use serve::Input;

#[allow(dead_code)]
#[path = "../../src/bin/serve/request.rs"]
mod request;

fuzz_target!(|data: &[u8]| {
    match request::parse_request(data) {
        Err(message) => assert!(!message.is_empty()),
        Ok(Input::Tree { tokens, parents }) => assert_eq!(tokens.len(), parents.len()),
        Ok(Input::Tokens(_)) => {}
        Ok(Input::F32(x)) => {
            let line = serde_json::to_string(&request::ResultLine::F32(request::F32s(&x))).unwrap();
            let back: serde_json::Value = serde_json::from_str(&line).expect("a result line is strict JSON");
            let values = back["output"].as_array().expect("an output array");
            assert_eq!(values.len(), x.len());
            for (v, &f) in values.iter().zip(&x) {
                match v.as_f64() {
                    Some(r) => assert!(f.is_finite() && r as f32 == f, "{f} written as {v}"),
                    None => assert!(!f.is_finite() && v.is_string(), "{f} written as {v}"),
                }
            }
        }
    }
});
