//! Validation and evaluation of `metav1.LabelSelector`, for namespace selectors.
//!
//! The sharder must decide locally which namespaces a ring covers (sync lists objects cluster-wide
//! and filters), and it must reject selectors the API server would reject in a webhook
//! configuration before writing one.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::labels::{is_valid_label_key, is_valid_label_value};

/// Describes the first problem found in `selector`, or `None` when the API server would accept it.
pub fn validate_label_selector(selector: &LabelSelector) -> Result<(), String> {
    for (key, value) in selector.match_labels.iter().flatten() {
        if !is_valid_label_key(key) {
            return Err(format!("matchLabels: invalid label key {key:?}"));
        }
        if !is_valid_label_value(value) {
            return Err(format!("matchLabels[{key}]: invalid label value {value:?}"));
        }
    }
    for (i, req) in selector.match_expressions.iter().flatten().enumerate() {
        let at = format!("matchExpressions[{i}]");
        if !is_valid_label_key(&req.key) {
            return Err(format!("{at}.key: invalid label key {:?}", req.key));
        }
        let values = req.values.as_deref().unwrap_or_default();
        match req.operator.as_str() {
            "In" | "NotIn" => {
                if values.is_empty() {
                    return Err(format!(
                        "{at}.values: must be non-empty for operator {}",
                        req.operator
                    ));
                }
                if let Some(bad) = values.iter().find(|v| !is_valid_label_value(v)) {
                    return Err(format!("{at}.values: invalid label value {bad:?}"));
                }
            }
            "Exists" | "DoesNotExist" => {
                if !values.is_empty() {
                    return Err(format!(
                        "{at}.values: must be empty for operator {}",
                        req.operator
                    ));
                }
            }
            other => {
                return Err(format!(
                    "{at}.operator: {other:?} is not one of In, NotIn, Exists, DoesNotExist"
                ));
            }
        }
    }
    Ok(())
}

/// Whether `labels` satisfy `selector`. An empty selector matches everything. The selector must
/// have passed [`validate_label_selector`]; unknown operators match nothing.
pub fn selector_matches(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let labels_ok = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    labels_ok
        && selector.match_expressions.iter().flatten().all(|req| {
            let value = labels.get(&req.key);
            let values = req.values.as_deref().unwrap_or_default();
            match req.operator.as_str() {
                "In" => value.is_some_and(|v| values.contains(v)),
                "NotIn" => value.is_none_or(|v| !values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                _ => false,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn req(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| v.to_string()).collect()),
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn validation() {
        let ok = LabelSelector {
            match_labels: Some(labels(&[("team", "a")])),
            match_expressions: Some(vec![
                req("kubernetes.io/metadata.name", "NotIn", &["kube-system"]),
                req("x", "Exists", &[]),
            ]),
        };
        assert_eq!(validate_label_selector(&ok), Ok(()));
        let bad_op = LabelSelector {
            match_expressions: Some(vec![req("x", "Equals", &["a"])]),
            ..Default::default()
        };
        assert!(
            validate_label_selector(&bad_op)
                .unwrap_err()
                .contains("operator")
        );
        let no_values = LabelSelector {
            match_expressions: Some(vec![req("x", "In", &[])]),
            ..Default::default()
        };
        assert!(
            validate_label_selector(&no_values)
                .unwrap_err()
                .contains("non-empty")
        );
        let values_on_exists = LabelSelector {
            match_expressions: Some(vec![req("x", "Exists", &["a"])]),
            ..Default::default()
        };
        assert!(validate_label_selector(&values_on_exists).is_err());
        let bad_key = LabelSelector {
            match_labels: Some(labels(&[("-x", "a")])),
            ..Default::default()
        };
        assert!(
            validate_label_selector(&bad_key)
                .unwrap_err()
                .contains("key")
        );
    }

    #[test]
    fn matching() {
        let sel = LabelSelector {
            match_labels: Some(labels(&[("team", "a")])),
            match_expressions: Some(vec![req("env", "NotIn", &["prod"])]),
        };
        assert!(selector_matches(&sel, &labels(&[("team", "a")])));
        assert!(selector_matches(
            &sel,
            &labels(&[("team", "a"), ("env", "dev")])
        ));
        assert!(!selector_matches(
            &sel,
            &labels(&[("team", "a"), ("env", "prod")])
        ));
        assert!(!selector_matches(&sel, &labels(&[("team", "b")])));
        assert!(selector_matches(&LabelSelector::default(), &labels(&[])));
        let exists = LabelSelector {
            match_expressions: Some(vec![req("x", "Exists", &[]), req("y", "DoesNotExist", &[])]),
            ..Default::default()
        };
        assert!(selector_matches(&exists, &labels(&[("x", "")])));
        assert!(!selector_matches(&exists, &labels(&[("x", ""), ("y", "")])));
        let within = LabelSelector {
            match_expressions: Some(vec![req("x", "In", &["1", "2"])]),
            ..Default::default()
        };
        assert!(selector_matches(&within, &labels(&[("x", "2")])));
        assert!(!selector_matches(&within, &labels(&[])));
    }
}
