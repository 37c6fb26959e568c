//! The MutatingWebhookConfiguration the sharder maintains for each ring (docs/protocol.md §8).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations, ServiceReference,
    WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta, OwnerReference,
};
use kube::ResourceExt;
use kube_sharding_api::config::{SharderConfig, WebhookConfig};
use kube_sharding_api::labels::{APP_NAME, LABEL_APP_NAME, WEBHOOK_NAME};
use kube_sharding_api::{GroupResource, RingObject};

/// Field manager of every write the sharder makes: server-side applies and label, status and
/// Lease patches.
pub const FIELD_MANAGER: &str = "sharder";

/// Builds the desired webhook configuration of `ring`. `ca_bundle` is the PEM bundle resolved from
/// the sharder config (inline or file), if any.
pub fn desired_webhook_configuration<R: RingObject>(
    ring: &R,
    config: &WebhookConfig,
    ca_bundle: Option<Vec<u8>>,
) -> MutatingWebhookConfiguration {
    let kind = R::KIND;
    let ring_name = ring.name_any();
    let spec = ring.ring_spec();
    let client = &config.client_config;
    let client_config = WebhookClientConfig {
        url: client
            .url
            .as_deref()
            .map(|base| SharderConfig::webhook_path_for(Some(base), kind, &ring_name)),
        service: client.service.as_ref().map(|s| ServiceReference {
            namespace: s.namespace.clone(),
            name: s.name.clone(),
            path: Some(SharderConfig::webhook_path_for(
                s.path.as_deref(),
                kind,
                &ring_name,
            )),
            port: s.port,
        }),
        ca_bundle: ca_bundle.map(ByteString),
    };

    let mut rules = Vec::new();
    for resource in &spec.resources {
        rules.push(rule(&resource.group_resource()));
        rules.extend(resource.controlled_resources.iter().map(rule));
    }

    let owner = OwnerReference {
        api_version: R::api_version(&()).into_owned(),
        kind: R::kind(&()).into_owned(),
        name: ring_name.clone(),
        uid: ring.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };

    MutatingWebhookConfiguration {
        metadata: ObjectMeta {
            name: Some(kind.webhook_configuration_name(&ring_name)),
            labels: Some(BTreeMap::from([
                (LABEL_APP_NAME.to_string(), APP_NAME.to_string()),
                (kind.lease_label().to_string(), ring_name.clone()),
            ])),
            annotations: (!config.annotations.is_empty()).then(|| config.annotations.clone()),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        webhooks: Some(vec![MutatingWebhook {
            name: WEBHOOK_NAME.into(),
            client_config,
            namespace_selector: Some(
                spec.namespace_selector
                    .clone()
                    .unwrap_or_else(|| config.namespace_selector.clone()),
            ),
            object_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: kind.shard_label(&ring_name),
                    operator: "DoesNotExist".into(),
                    values: None,
                }]),
                match_labels: None,
            }),
            rules: Some(rules),
            failure_policy: Some("Ignore".into()),
            timeout_seconds: Some(5),
            side_effects: "None".into(),
            admission_review_versions: vec!["v1".into()],
            ..Default::default()
        }]),
    }
}

fn rule(gr: &GroupResource) -> RuleWithOperations {
    RuleWithOperations {
        operations: Some(vec!["CREATE".into(), "UPDATE".into()]),
        api_groups: Some(vec![gr.group.clone()]),
        api_versions: Some(vec!["*".into()]),
        resources: Some(vec![gr.resource.clone()]),
        scope: Some("*".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_sharding_api::ClusterRing;
    use kube_sharding_api::config::{
        ServiceReference as ConfigService, WebhookClientConfig as Cfg,
    };

    fn ring() -> ClusterRing {
        let mut ring = crate::test_rings::secrets_ring("example");
        ring.metadata.uid = Some("uid-1".into());
        ring
    }

    #[test]
    fn service_client_config_and_fixed_fields() {
        let config = WebhookConfig::default();
        let wc = desired_webhook_configuration(&ring(), &config, None);
        assert_eq!(
            wc.metadata.name.as_deref(),
            Some("sharding-clusterring-50d858e0-example")
        );
        let labels = wc.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels["app.kubernetes.io/name"], "controller-sharding");
        assert_eq!(
            labels["alpha.sharding.timebertt.dev/clusterring"],
            "example"
        );
        let owner = &wc.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (
                owner.kind.as_str(),
                owner.name.as_str(),
                owner.uid.as_str(),
                owner.controller
            ),
            ("ClusterRing", "example", "uid-1", Some(true))
        );
        let hooks = wc.webhooks.expect("webhooks");
        assert_eq!(hooks.len(), 1);
        let hook = &hooks[0];
        assert_eq!(hook.name, "sharder.sharding.timebertt.dev");
        let service = hook.client_config.service.as_ref().expect("service");
        assert_eq!(service.namespace, "sharding-system");
        assert_eq!(service.name, "sharder");
        assert_eq!(
            service.path.as_deref(),
            Some("/webhooks/sharder/clusterring/example")
        );
        assert_eq!(hook.failure_policy.as_deref(), Some("Ignore"));
        assert_eq!(hook.timeout_seconds, Some(5));
        assert_eq!(hook.side_effects, "None");
        assert_eq!(hook.admission_review_versions, ["v1"]);
        assert_eq!(hook.namespace_selector, Some(config.namespace_selector));
        let object_selector = hook.object_selector.clone().expect("object selector");
        let req = &object_selector.match_expressions.expect("expressions")[0];
        assert_eq!(
            req.key,
            "shard.alpha.sharding.timebertt.dev/clusterring-50d858e0-example"
        );
        assert_eq!(req.operator, "DoesNotExist");
        let rules = hook.rules.clone().expect("rules");
        let resources: Vec<_> = rules
            .iter()
            .map(|r| r.resources.clone().unwrap_or_default().join(","))
            .collect();
        assert_eq!(resources, ["secrets", "configmaps"]);
        for r in &rules {
            assert_eq!(
                r.operations.as_deref(),
                Some(&["CREATE".into(), "UPDATE".into()][..])
            );
            assert_eq!(r.api_groups.as_deref(), Some(&[String::new()][..]));
            assert_eq!(r.api_versions.as_deref(), Some(&["*".to_string()][..]));
            assert_eq!(r.scope.as_deref(), Some("*"));
        }
    }

    #[test]
    fn url_client_config_ring_selector_annotations_and_ca() {
        let mut config = WebhookConfig {
            client_config: Cfg {
                url: Some("https://127.0.0.1:9443/".into()),
                service: None,
                ca_bundle: None,
                ca_bundle_file: None,
            },
            ..Default::default()
        };
        config
            .annotations
            .insert("cert-manager.io/inject-ca-from".into(), "a/b".into());
        let mut r = ring();
        let selector = LabelSelector {
            match_labels: Some([("team".to_string(), "a".to_string())].into()),
            match_expressions: None,
        };
        r.spec.namespace_selector = Some(selector.clone());
        let wc = desired_webhook_configuration(&r, &config, Some(b"PEM".to_vec()));
        assert_eq!(wc.metadata.annotations, Some(config.annotations.clone()));
        let hook = &wc.webhooks.expect("webhooks")[0];
        assert_eq!(
            hook.client_config.url.as_deref(),
            Some("https://127.0.0.1:9443/webhooks/sharder/clusterring/example")
        );
        assert_eq!(
            hook.client_config.ca_bundle,
            Some(ByteString(b"PEM".to_vec()))
        );
        assert_eq!(hook.namespace_selector, Some(selector));

        config.client_config = Cfg {
            url: None,
            service: Some(ConfigService {
                namespace: "ns".into(),
                name: "svc".into(),
                path: Some("/base/".into()),
                port: Some(8443),
            }),
            ca_bundle: None,
            ca_bundle_file: None,
        };
        let wc = desired_webhook_configuration(&ring(), &config, None);
        let service = wc.webhooks.expect("webhooks")[0]
            .client_config
            .service
            .clone()
            .expect("service");
        assert_eq!(
            service.path.as_deref(),
            Some("/base/webhooks/sharder/clusterring/example")
        );
        assert_eq!(service.port, Some(8443));
    }

    #[test]
    fn controller_ring_names_path_labels_and_owner() {
        let mut ring = kube_sharding_api::ControllerRing::new("example", ring().spec.into());
        ring.metadata.uid = Some("uid-2".into());
        let wc = desired_webhook_configuration(&ring, &WebhookConfig::default(), None);
        assert_eq!(wc.metadata.name.as_deref(), Some("controllerring-example"));
        let labels = wc.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get("alpha.sharding.timebertt.dev/controllerring"),
            Some(&"example".to_string())
        );
        assert!(!labels.contains_key("alpha.sharding.timebertt.dev/clusterring"));
        let owner = &wc.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("ControllerRing", "uid-2")
        );
        let hook = &wc.webhooks.expect("webhooks")[0];
        assert_eq!(
            hook.client_config
                .service
                .as_ref()
                .and_then(|s| s.path.as_deref()),
            Some("/webhooks/sharder/controllerring/example")
        );
        let selector = hook.object_selector.clone().expect("object selector");
        assert_eq!(
            selector.match_expressions.expect("expressions")[0].key,
            "shard.alpha.sharding.timebertt.dev/example"
        );
    }
}
