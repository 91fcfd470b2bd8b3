//! The controller's status writes as JSON merge patches (RFC 7396), pure.
//!
//! A status write used to be a server-side apply. The apiserver pays for an apply with a
//! structured merge of the applied configuration into the live object and its managed
//! fields — about 3 ms of its CPU each on this machine's runs, three per new Service:
//! at 10 000 Services that was most of the apiserver's work (perf/README.md). A merge
//! patch of what changed costs it a plain JSON merge. Both stay conditioned on the
//! `resourceVersion` the decision was made from (`metadata.resourceVersion` in the
//! patch: a 409 Conflict when the object moved since), so a stale copy still costs a
//! retry, never an overwrite.
//!
//! An apply removes the fields the applied status no longer has; a merge patch only
//! removes what it sets to `null`. So the patch is made from the status the decision
//! read and the new one ([`merge_diff`]): a key gone is `null`, an object changed is
//! patched key by key, anything else (arrays too) is replaced whole. Applied to the
//! status it was made from, it gives the new one exactly ([`tests`]).

use serde_json::{json, Map, Value};

/// The merge patch that turns `old` into `new` (RFC 7396); `None` when they are equal.
pub fn merge_diff(old: &Value, new: &Value) -> Option<Value> {
    if old == new {
        return None;
    }
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut patch = Map::new();
            for (k, v) in n {
                let changed = match o.get(k) {
                    Some(was) => merge_diff(was, v),
                    None => Some(v.clone()),
                };
                if let Some(c) = changed {
                    patch.insert(k.clone(), c);
                }
            }
            for k in o.keys().filter(|k| !n.contains_key(*k)) {
                patch.insert(k.clone(), Value::Null);
            }
            Some(Value::Object(patch))
        }
        // A `null` in `new` cannot be written by a merge patch (it means "remove");
        // statuses never hold one (their optional fields are left out instead).
        _ => Some(new.clone()),
    }
}

/// A merge patch of an object's `status` from `old` (what the decision read; `None`:
/// no status yet) to `new`, conditioned on `resource_version` when given; `None` when
/// nothing changed.
pub fn status_patch(
    old: Option<&Value>,
    new: &Value,
    resource_version: Option<&str>,
) -> Option<Value> {
    let status = match old {
        Some(o) => merge_diff(o, new)?,
        None => new.clone(),
    };
    let mut patch = json!({ "status": status });
    if let Some(rv) = resource_version {
        patch["metadata"] = json!({ "resourceVersion": rv });
    }
    Some(patch)
}

/// One merge patch of a whole record — `metadata.ownerReferences`, `spec` and `status`
/// each only when it changed from `old` (the record as the decision read it, a JSON
/// object) to `new` — conditioned on `resource_version`; `None` when nothing changed.
/// For a kind without a status subresource (the ServiceLoadBalancer since 2026-12-07),
/// whose spec and status one request writes.
pub fn record_patch(old: &Value, new: &Value, resource_version: Option<&str>) -> Option<Value> {
    let mut patch = Map::new();
    for part in ["spec", "status"] {
        let (was, now) = (old.get(part), new.get(part).unwrap_or(&Value::Null));
        let changed = match was {
            Some(w) if !now.is_null() => merge_diff(w, now),
            Some(_) => Some(Value::Null),
            None => (!now.is_null()).then(|| now.clone()),
        };
        if let Some(c) = changed {
            patch.insert(part.into(), c);
        }
    }
    let owners = |o: &Value| o.pointer("/metadata/ownerReferences").cloned();
    let mut metadata = Map::new();
    if owners(old) != owners(new) {
        metadata.insert("ownerReferences".into(), owners(new).unwrap_or(Value::Null));
    }
    if patch.is_empty() && metadata.is_empty() {
        return None;
    }
    if let Some(rv) = resource_version {
        metadata.insert("resourceVersion".into(), json!(rv));
    }
    if !metadata.is_empty() {
        patch.insert("metadata".into(), Value::Object(metadata));
    }
    Some(Value::Object(patch))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7396's MergePatch, to check that a diff applied gives the new document.
    fn apply(target: &Value, patch: &Value) -> Value {
        let Value::Object(p) = patch else {
            return patch.clone();
        };
        let mut t = match target {
            Value::Object(m) => m.clone(),
            _ => Map::new(),
        };
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                let merged = apply(t.get(k).unwrap_or(&Value::Null), v);
                t.insert(k.clone(), merged);
            }
        }
        Value::Object(t)
    }

    fn status(vip: Option<&str>, nodes: &[&str], ready: bool) -> Value {
        let mut s = json!({
            "advertisingNodes": nodes,
            "backendSummary": {"totalReady": nodes.len(), "localReadyNodes": nodes.len()},
            "phase": if ready { "Ready" } else { "Pending" },
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        });
        if let Some(v) = vip {
            s["vip"] = json!(v);
            s["addressPool"] = json!("public-v4");
        }
        s
    }

    #[test]
    fn a_diff_applied_to_the_old_status_gives_the_new_one() {
        let cases = [
            (
                status(None, &[], false),
                status(Some("203.0.113.10"), &["a", "b"], true),
            ),
            (
                status(Some("203.0.113.10"), &["a", "b"], true),
                status(Some("203.0.113.10"), &["b"], true),
            ),
            // Fields the new status no longer has are removed, not left behind.
            (
                status(Some("203.0.113.10"), &["a"], true),
                status(None, &[], false),
            ),
            (
                json!({"a": {"b": 1, "c": [1, 2]}}),
                json!({"a": {"c": [2]}, "d": "x"}),
            ),
        ];
        for (old, new) in cases {
            let patch = merge_diff(&old, &new).expect("they differ");
            assert_eq!(apply(&old, &patch), new, "patch {patch}");
        }
    }

    #[test]
    fn only_what_changed_is_sent() {
        let old = status(Some("203.0.113.10"), &["a", "b"], true);
        let new = status(Some("203.0.113.10"), &["a"], true);
        let patch = merge_diff(&old, &new).unwrap();
        assert_eq!(
            patch,
            json!({
                "advertisingNodes": ["a"],
                "backendSummary": {"totalReady": 1, "localReadyNodes": 1},
            })
        );
        assert_eq!(merge_diff(&old, &old), None);
    }

    #[test]
    fn the_patch_carries_the_resource_version_it_was_decided_from() {
        let new = status(Some("203.0.113.10"), &["a"], true);
        let p = status_patch(None, &new, Some("42")).unwrap();
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        assert_eq!(p["status"], new);
        let p = status_patch(Some(&status(None, &[], false)), &new, None).unwrap();
        assert!(p.get("metadata").is_none());
        assert_eq!(status_patch(Some(&new), &new, Some("42")), None);
    }

    fn record(owner: &str, requested: Option<&str>, status: Option<Value>) -> Value {
        let mut r = json!({
            "metadata": {"name": "web", "ownerReferences": [{"uid": owner}]},
            "spec": {"serviceName": "web"},
        });
        if let Some(ip) = requested {
            r["spec"]["requestedIP"] = json!(ip);
        }
        if let Some(s) = status {
            r["status"] = s;
        }
        r
    }

    #[test]
    fn a_record_patch_writes_spec_status_and_owner_together_and_only_what_changed() {
        let ready = status(Some("203.0.113.10"), &["a"], true);
        let old = record("u1", Some("203.0.113.10"), None);
        // No status yet, a requested IP dropped, the Service created again (new uid).
        let new = record("u2", None, Some(ready.clone()));
        let p = record_patch(&old, &new, Some("7")).unwrap();
        assert_eq!(p["metadata"]["resourceVersion"], "7");
        assert_eq!(p["metadata"]["ownerReferences"], json!([{"uid": "u2"}]));
        assert_eq!(p["spec"], json!({"requestedIP": null}));
        assert_eq!(p["status"], ready);
        let mut got = apply(&old, &p);
        got["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("resourceVersion");
        assert_eq!(got, new);
        // Only the status moved: neither spec nor owners are sent.
        let moved = record("u2", None, Some(status(Some("203.0.113.10"), &[], true)));
        let p = record_patch(&new, &moved, Some("8")).unwrap();
        assert_eq!(
            p.as_object().unwrap().keys().collect::<Vec<_>>(),
            ["metadata", "status"]
        );
        assert_eq!(p["metadata"], json!({"resourceVersion": "8"}));
        assert_eq!(record_patch(&moved, &moved, Some("9")), None);
    }
}
