//! What a real API server does that the fake ones of the agent's and the scorer's tests copy, so that
//! what passes against them passes against a cluster:
//! - it stores pods with each container's requests defaulted to its limits, and every resource
//!   quantity in the form it writes back (`5000` comes back as `5k`);
//! - it filters lists by the field selectors pods support.

#![allow(dead_code)]

use gpumem::quantity::Quantity;
use serde_json::{Value, json};

/// The decoded value of `key` in a URL query.
pub fn query_param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (percent_decode(k) == key).then(|| percent_decode(v))
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

// ---------------------------------------------------------------------------------------------
// Stored objects

/// `pod` as the API server stores and returns it: each container's requests default to its limits
/// (SetDefaults_Pod), and every resource quantity is in stored form. Panics on a quantity the API
/// server would refuse.
pub fn stored_pod(pod: &Value) -> Value {
    let mut pod = pod.clone();
    for list in ["/spec/containers", "/spec/initContainers"] {
        let containers = pod.pointer_mut(list).and_then(Value::as_array_mut);
        for resources in containers
            .into_iter()
            .flatten()
            .filter_map(|c| c.get_mut("resources"))
        {
            let limits = resources.get("limits").and_then(Value::as_object).cloned();
            if let (Some(limits), Some(resources)) = (limits, resources.as_object_mut())
                && let Some(requests) = resources
                    .entry("requests")
                    .or_insert_with(|| json!({}))
                    .as_object_mut()
            {
                for (name, limit) in limits {
                    requests.entry(name).or_insert(limit);
                }
            }
            for list in ["limits", "requests"] {
                if let Some(list) = resources.get_mut(list) {
                    store_quantities(list);
                }
            }
        }
    }
    for list in [
        "/spec/overhead",
        "/spec/resources/limits",
        "/spec/resources/requests",
    ] {
        if let Some(list) = pod.pointer_mut(list) {
            store_quantities(list);
        }
    }
    pod
}

/// `node` as the API server stores and returns it: capacity and allocatable in stored form.
pub fn stored_node(node: &Value) -> Value {
    let mut node = node.clone();
    for list in ["/status/capacity", "/status/allocatable"] {
        if let Some(list) = node.pointer_mut(list) {
            store_quantities(list);
        }
    }
    node
}

fn store_quantities(list: &mut Value) {
    for (name, q) in list.as_object_mut().into_iter().flatten() {
        // JSON numbers are quantities too (the API server reads the number's text).
        let text = match q {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => continue,
        };
        let stored = Quantity::stored(&text).unwrap_or_else(|e| {
            panic!("{name}: {text:?} is not a quantity ({e}): the API server refuses it")
        });
        *q = Value::String(stored);
    }
}

/// Whether `pod` passes a list's `fieldSelector` (comma-separated `field=value`, `field==value` or
/// `field!=value`); `Err` with the API server's message for a field pods cannot be selected by.
pub fn pod_matches_fields(pod: &Value, query: &str) -> Result<bool, String> {
    let Some(selector) = query_param(query, "fieldSelector").filter(|s| !s.is_empty()) else {
        return Ok(true);
    };
    for term in selector.split(',') {
        let (field, want, equal) = if let Some((f, v)) = term.split_once("!=") {
            (f, v, false)
        } else if let Some((f, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            (f, v, true)
        } else {
            return Err(format!("invalid selector: {term:?}"));
        };
        let pointer = match field {
            "metadata.name" => "/metadata/name",
            "metadata.namespace" => "/metadata/namespace",
            "spec.nodeName" => "/spec/nodeName",
            "spec.schedulerName" => "/spec/schedulerName",
            "status.phase" => "/status/phase",
            other => return Err(format!("field label not supported: {other}")),
        };
        let have = pod.pointer(pointer).and_then(Value::as_str).unwrap_or("");
        if (have == want) != equal {
            return Ok(false);
        }
    }
    Ok(true)
}
