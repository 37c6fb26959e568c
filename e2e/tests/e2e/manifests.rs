//! The install manifests (`config/`, `deploy/`): every kustomization renders, the API server
//! accepts every rendered object (server-side dry run), the shipped SharderConfigs are valid and
//! fit the Deployment that mounts them, the RBAC grants exactly what docs/protocol.md §14 lists
//! (plus `clusterrings/finalizers` update, which owner references with `blockOwnerDeletion` need,
//! and the reviews of metrics scrapers), the ServiceMonitor scrapes the secure metrics, both
//! installs include the admission policies (and only their Kubernetes 1.29 variants leave them
//! out), and the example rings take shards only from the shards' namespace.
//!
//! Rendering uses `kubectl kustomize` of the kubectl built with the test control plane
//! ([`e2e::kubectl`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use e2e::metrics_access::{METRICS_READER, shipped_metrics_reader};
use e2e::{FIELD_MANAGER, cluster, kubectl, serves_admission_policies};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use kube_sharding_api::config::SharderConfig;
use serde_json::{Value, json};

/// Every kustomization we ship, relative to the workspace root. `config/certificate` and
/// `config/overlays/k8s-1.29/without-admission-policies` are components and are rendered through
/// the installs that use them.
const KUSTOMIZATIONS: &[&str] = &[
    "config/crds",
    "config/rbac",
    "config/sharder",
    "config/monitoring",
    "config/default",
    "config/overlays/no-cert-manager",
    "config/overlays/k8s-1.29/default",
    "config/overlays/k8s-1.29/no-cert-manager",
    "config/admission-policies",
    "config/release/install",
    "config/release/install-cert-manager",
    "config/external-metrics",
    "deploy/base",
    "deploy/clusterring",
    "deploy",
    "deploy/controllerring",
    "deploy/statefulset",
    "deploy/autoscaling",
];

/// Components: rendered only as part of a kustomization that uses them.
const COMPONENTS: &[&str] = &[
    "config/certificate",
    "config/network-policy",
    "config/overlays/k8s-1.29/without-admission-policies",
];

/// Kinds of other projects our manifests use, with their plural names: the test control plane
/// has no CRDs for them, so the dry run installs stand-ins that accept any content. Everything
/// else, our CRD with its CEL rule and the `policy/v1` PodDisruptionBudget included, is checked by
/// the real server as it is.
const FOREIGN_KINDS: &[(&str, &str, &str, &str)] = &[
    ("cert-manager.io", "v1", "Issuer", "issuers"),
    ("cert-manager.io", "v1", "Certificate", "certificates"),
    (
        "monitoring.coreos.com",
        "v1",
        "ServiceMonitor",
        "servicemonitors",
    ),
    (
        "monitoring.coreos.com",
        "v1",
        "PrometheusRule",
        "prometheusrules",
    ),
];

const SYSTEM_NAMESPACE: &str = "sharding-system";
const SHARDER: &str = "sharder";
const SHARDER_CONFIG_MAP: &str = "sharder-config";

pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e/ has a parent")
        .to_path_buf()
}

/// Renders a kustomization into its objects.
pub(crate) fn render(dir: &str) -> anyhow::Result<Vec<Value>> {
    let out = Command::new(kubectl())
        .arg("kustomize")
        .arg(workspace_root().join(dir))
        .output()
        .context("failed to run kubectl")?;
    if !out.status.success() {
        bail!(
            "kubectl kustomize {dir} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8(out.stdout).context("kustomize printed no UTF-8")?;
    parse_documents(&text, dir)
}

/// The objects of a multi-document YAML text as kustomize writes it (`what` names it in errors).
pub(crate) fn parse_documents(text: &str, what: &str) -> anyhow::Result<Vec<Value>> {
    // kustomize separates documents with `---` lines; block scalars are indented, so a bare `---`
    // line never occurs inside a document.
    let mut documents = vec![String::new()];
    for line in text.lines() {
        if line == "---" {
            documents.push(String::new());
        } else if let Some(current) = documents.last_mut() {
            current.push_str(line);
            current.push('\n');
        }
    }
    documents
        .iter()
        .filter(|doc| !doc.trim().is_empty())
        .map(|doc| {
            serde_yaml::from_str::<Value>(doc)
                .with_context(|| format!("{what} holds a document that is not YAML:\n{doc}"))
        })
        .collect()
}

pub(crate) fn str_at<'a>(value: &'a Value, pointer: &str) -> &'a str {
    value.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

pub(crate) fn kind(object: &Value) -> &str {
    str_at(object, "/kind")
}

pub(crate) fn name(object: &Value) -> &str {
    str_at(object, "/metadata/name")
}

pub(crate) fn namespace(object: &Value) -> &str {
    str_at(object, "/metadata/namespace")
}

fn describe(object: &Value) -> String {
    match namespace(object) {
        "" => format!("{} {}", kind(object), name(object)),
        ns => format!("{} {ns}/{}", kind(object), name(object)),
    }
}

fn find<'a>(objects: &'a [Value], kind_: &str, name_: &str) -> anyhow::Result<&'a Value> {
    objects
        .iter()
        .find(|o| kind(o) == kind_ && name(o) == name_)
        .with_context(|| format!("no {kind_} {name_} rendered"))
}

fn only<'a>(objects: &'a [Value], kind_: &str) -> anyhow::Result<&'a Value> {
    let mut matching = objects.iter().filter(|o| kind(o) == kind_);
    match (matching.next(), matching.next()) {
        (Some(object), None) => Ok(object),
        _ => bail!("expected exactly one {kind_}"),
    }
}

/// The SharderConfig in the rendered ConfigMap, parsed and validated like the sharder does.
fn sharder_config(objects: &[Value]) -> anyhow::Result<SharderConfig> {
    let config_map = find(objects, "ConfigMap", SHARDER_CONFIG_MAP)?;
    let text = config_map
        .pointer("/data/config.yaml")
        .and_then(Value::as_str)
        .context("ConfigMap sharder-config has no config.yaml")?;
    SharderConfig::from_yaml(text).context("the sharder rejects the shipped config")
}

/// `(apiGroup, resource, verb)` for every combination a role's rules grant.
fn grants(role: &Value) -> anyhow::Result<BTreeSet<(String, String, String)>> {
    let mut set = BTreeSet::new();
    let rules = role["rules"].as_array().context("role without rules")?;
    for rule in rules {
        ensure!(
            rule.get("resourceNames").is_none() && rule.get("nonResourceURLs").is_none(),
            "{}: unexpected rule {rule}",
            describe(role)
        );
        let strings = |key: &str| -> Vec<String> {
            rule[key]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        };
        for group in strings("apiGroups") {
            for resource in strings("resources") {
                for verb in strings("verbs") {
                    set.insert((group.clone(), resource.clone(), verb));
                }
            }
        }
    }
    Ok(set)
}

fn expected_grants(entries: &[(&[&str], &str, &[&str])]) -> BTreeSet<(String, String, String)> {
    let mut set = BTreeSet::new();
    for (groups, resource, verbs) in entries {
        for group in *groups {
            for verb in *verbs {
                set.insert((group.to_string(), resource.to_string(), verb.to_string()));
            }
        }
    }
    set
}

/// Whether `binding` binds role `role_kind`/`role_name` to the ServiceAccount `ns`/`sa`.
fn binds(binding: &Value, role_kind: &str, role_name: &str, ns: &str, sa: &str) -> bool {
    str_at(binding, "/roleRef/kind") == role_kind
        && str_at(binding, "/roleRef/name") == role_name
        && binding["subjects"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|s| {
                str_at(s, "/kind") == "ServiceAccount"
                    && str_at(s, "/namespace") == ns
                    && str_at(s, "/name") == sa
            })
}

#[test]
fn every_kustomization_renders() -> anyhow::Result<()> {
    for dir in KUSTOMIZATIONS {
        let objects = render(dir)?;
        ensure!(!objects.is_empty(), "{dir} renders nothing");
        for object in &objects {
            ensure!(
                !str_at(object, "/apiVersion").is_empty() && !kind(object).is_empty(),
                "{dir}: object without apiVersion or kind: {object}"
            );
            ensure!(!name(object).is_empty(), "{dir}: object without a name");
        }
    }
    // Nothing shipped escapes the list above.
    let mut found = BTreeSet::new();
    for top in ["config", "deploy"] {
        collect_kustomizations(&workspace_root(), &workspace_root().join(top), &mut found)?;
    }
    let listed: BTreeSet<String> = KUSTOMIZATIONS.iter().map(|d| d.to_string()).collect();
    let missing: Vec<_> = found
        .difference(&listed)
        .filter(|d| !COMPONENTS.contains(&d.as_str()))
        .collect();
    ensure!(missing.is_empty(), "kustomizations not tested: {missing:?}");
    Ok(())
}

fn collect_kustomizations(
    root: &Path,
    dir: &Path,
    found: &mut BTreeSet<String>,
) -> anyhow::Result<()> {
    if dir.join("kustomization.yaml").is_file() {
        let relative = dir.strip_prefix(root)?.to_string_lossy().into_owned();
        found.insert(relative);
    }
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_kustomizations(root, &path, found)?;
        }
    }
    Ok(())
}

/// An overlay of `config/overlays/no-cert-manager` with the `config/network-policy` component, as
/// a user adds it, written under `target/` (kustomize takes no absolute paths); its directory
/// relative to the workspace root.
fn network_policy_overlay() -> anyhow::Result<&'static str> {
    const DIR: &str = "target/e2e-network-policy-overlay";
    let dir = workspace_root().join(DIR);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n\
         - ../../config/overlays/no-cert-manager\ncomponents:\n- ../../config/network-policy\n",
    )?;
    Ok(DIR)
}

/// The optional NetworkPolicy selects the sharder's pods and names ports its container has.
#[test]
fn network_policy_fits_the_sharder() -> anyhow::Result<()> {
    let objects = render(network_policy_overlay()?)?;
    let policy = only(&objects, "NetworkPolicy")?;
    let deployment = find(&objects, "Deployment", SHARDER)?;
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (key, value) in policy["spec"]["podSelector"]["matchLabels"]
        .as_object()
        .context("no podSelector.matchLabels")?
    {
        ensure!(
            &pod_labels[key] == value,
            "the policy selects {key}={value}, the pods are {pod_labels}"
        );
    }
    let container = container(deployment, SHARDER)?;
    for rule in policy["spec"]["ingress"]
        .as_array()
        .context("no ingress rules")?
    {
        for port in rule["ports"].as_array().into_iter().flatten() {
            let port = str_at(port, "/port");
            ensure!(
                container_port(container, port).is_some(),
                "the policy names port {port}, which the container lacks"
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn rendered_objects_pass_server_side_dry_run() -> anyhow::Result<()> {
    let cluster = cluster();
    let client = cluster.client().await?;
    let with_policy = network_policy_overlay()?;
    let rendered: Vec<(&str, Vec<Value>)> = KUSTOMIZATIONS
        .iter()
        .chain([&with_policy])
        .map(|dir| Ok((*dir, render(dir)?)))
        .collect::<anyhow::Result<_>>()?;

    let policies_served =
        serves_admission_policies(cluster, "config/admission-policies in this dry run")?;
    let foreign_served = install_foreign_crds(&client, cluster.state_dir().is_some()).await?;
    let created_namespaces = create_missing_namespaces(&client, &rendered).await?;

    let mut failures = Vec::new();
    for (dir, objects) in &rendered {
        let mut items = Vec::new();
        for object in objects {
            if !policies_served && is_admission_policy(object) {
                continue;
            }
            let api_version = str_at(object, "/apiVersion");
            let foreign = FOREIGN_KINDS
                .iter()
                .any(|(g, v, k, _)| format!("{g}/{v}") == api_version && *k == kind(object));
            if foreign && !foreign_served.contains(kind(object)) {
                println!(
                    "note: {dir}: skipping {}, its CRD is not installed",
                    describe(object)
                );
                continue;
            }
            items.push(object.clone());
        }
        if let Err(error) = dry_run(cluster.kubeconfig(), dir, items) {
            failures.push(format!("{error:#}"));
        }
    }

    let namespaces: Api<Namespace> = Api::all(client.clone());
    for name in created_namespaces {
        let _ = namespaces.delete(&name, &DeleteParams::default()).await;
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Server-side dry run of `items` with kubectl, as a user's `kubectl apply --server-side` would
/// send them. Validation is the server's (`--validate=false` only skips kubectl's own schema
/// download).
pub(crate) fn dry_run(kubeconfig: &Path, dir: &str, items: Vec<Value>) -> anyhow::Result<()> {
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    let file = std::env::temp_dir().join(format!("{}.json", e2e::unique_name("manifests")));
    std::fs::write(&file, serde_json::to_vec(&list)?)?;
    let out = Command::new(kubectl())
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args([
            "apply",
            "--server-side",
            "--dry-run=server",
            "--validate=false",
            "--force-conflicts",
            &format!("--field-manager={FIELD_MANAGER}"),
            "-f",
        ])
        .arg(&file)
        .output()
        .context("failed to run kubectl");
    let _ = std::fs::remove_file(&file);
    let out = out?;
    ensure!(
        out.status.success(),
        "server-side dry run of {dir} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Makes sure the server serves [`FOREIGN_KINDS`]: real CRDs if installed, else (only on the
/// control plane the tests started, never on a user's cluster) stand-ins accepting any content.
/// Returns the kinds served.
pub(crate) async fn install_foreign_crds(
    client: &Client,
    may_install: bool,
) -> anyhow::Result<BTreeSet<&'static str>> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut served = BTreeSet::new();
    for (group, version, kind_, plural) in FOREIGN_KINDS {
        let crd_name = format!("{plural}.{group}");
        if crds.get_opt(&crd_name).await?.is_some() {
            served.insert(*kind_);
            continue;
        }
        if !may_install {
            continue;
        }
        let crd: CustomResourceDefinition = serde_json::from_value(json!({
            "metadata": {"name": crd_name},
            "spec": {
                "group": group,
                "names": {"kind": kind_, "plural": plural},
                "scope": "Namespaced",
                "versions": [{
                    "name": version,
                    "served": true,
                    "storage": true,
                    "schema": {"openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": true,
                    }},
                }],
            },
        }))?;
        match crds.create(&PostParams::default(), &crd).await {
            Ok(_) => {}
            // Another run against the same cluster got there first.
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => return Err(error).context(format!("failed to create CRD {crd_name}")),
        }
        tokio::time::timeout(
            Duration::from_secs(30),
            await_condition(crds.clone(), &crd_name, conditions::is_crd_established()),
        )
        .await
        .with_context(|| format!("CRD {crd_name} not Established within 30s"))??;
        served.insert(*kind_);
    }
    Ok(served)
}

/// Creates, for real, the namespaces the rendered objects live in that do not exist yet, so the
/// dry run of their objects can succeed. Returns the names created.
pub(crate) async fn create_missing_namespaces(
    client: &Client,
    rendered: &[(&str, Vec<Value>)],
) -> anyhow::Result<Vec<String>> {
    let api: Api<Namespace> = Api::all(client.clone());
    let wanted: BTreeSet<&str> = rendered
        .iter()
        .flat_map(|(_, objects)| objects)
        .map(namespace)
        .filter(|ns| !ns.is_empty())
        .collect();
    let mut created = Vec::new();
    for name in wanted {
        if api.get_opt(name).await?.is_some() {
            continue;
        }
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}}))?;
        api.create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("failed to create namespace {name}"))?;
        created.push(name.to_string());
    }
    Ok(created)
}

/// The container `name` of a rendered Deployment.
fn container<'a>(deployment: &'a Value, name_: &str) -> anyhow::Result<&'a Value> {
    deployment
        .pointer("/spec/template/spec/containers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|c| str_at(c, "/name") == name_)
        .with_context(|| format!("{} has no container {name_}", describe(deployment)))
}

/// Where the volume whose `source_pointer` (e.g. `/secret/secretName`) equals `source` is mounted.
fn mount_path_of(
    deployment: &Value,
    container: &Value,
    source_pointer: &str,
    source: &str,
) -> anyhow::Result<String> {
    let volume = deployment
        .pointer("/spec/template/spec/volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|v| str_at(v, source_pointer) == source)
        .with_context(|| format!("no volume with {source_pointer} = {source}"))?;
    let mount = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| str_at(m, "/name") == str_at(volume, "/name"))
        .with_context(|| format!("volume {} is not mounted", str_at(volume, "/name")))?;
    Ok(str_at(mount, "/mountPath").to_string())
}

fn container_port(container: &Value, port_name: &str) -> Option<u64> {
    container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| str_at(p, "/name") == port_name)
        .and_then(|p| p["containerPort"].as_u64())
}

fn bind_port(address: &str) -> anyhow::Result<Option<u64>> {
    let addr =
        kube_sharding_api::config::parse_bind_address(address).map_err(anyhow::Error::msg)?;
    Ok(addr.map(|a| u64::from(a.port())))
}

/// The SharderConfig of a rendered install fits its Deployment and Service: config path, cert
/// directory, ports and the webhook's Service reference.
fn check_sharder_install(objects: &[Value]) -> anyhow::Result<(SharderConfig, String)> {
    let config = sharder_config(objects)?;
    let deployment = find(objects, "Deployment", SHARDER)?;
    let sharder = container(deployment, SHARDER)?;

    let config_dir = mount_path_of(deployment, sharder, "/configMap/name", SHARDER_CONFIG_MAP)?;
    let config_arg = format!("--config={}/config.yaml", config_dir.trim_end_matches('/'));
    ensure!(
        sharder["args"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|a| a.as_str() == Some(config_arg.as_str())),
        "the sharder is not started with {config_arg}"
    );

    let secret = deployment
        .pointer("/spec/template/spec/volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find_map(|v| v.pointer("/secret/secretName").and_then(Value::as_str))
        .context("the sharder mounts no Secret")?
        .to_string();
    let cert_dir = mount_path_of(deployment, sharder, "/secret/secretName", &secret)?;
    ensure!(
        config.webhook.server.cert_dir == Path::new(&cert_dir),
        "certDir {} is not where the Secret is mounted ({cert_dir})",
        config.webhook.server.cert_dir.display()
    );

    for (port_name, address) in [
        ("webhook", &config.webhook.server.bind_address),
        ("metrics", &config.metrics.bind_address),
        ("health", &config.health.bind_address),
    ] {
        ensure!(
            container_port(sharder, port_name) == bind_port(address)?,
            "container port {port_name} does not match bind address {address}"
        );
    }
    for probe in ["readinessProbe", "livenessProbe"] {
        ensure!(
            str_at(sharder, &format!("/{probe}/httpGet/port")) == "health",
            "{probe} does not use the health port"
        );
    }
    let probe_paths = (
        str_at(sharder, "/readinessProbe/httpGet/path"),
        str_at(sharder, "/livenessProbe/httpGet/path"),
    );
    ensure!(probe_paths == ("/readyz", "/healthz"), "probe paths");

    let service_ref = config
        .webhook
        .config
        .client_config
        .service
        .as_ref()
        .context("the webhook is not reached through a Service")?;
    let service = find(objects, "Service", &service_ref.name)?;
    ensure!(
        namespace(service) == service_ref.namespace,
        "Service namespace"
    );
    let webhook_port = service["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| str_at(p, "/name") == "webhook")
        .context("the Service has no webhook port")?;
    ensure!(
        webhook_port["port"].as_i64() == Some(service_ref.port.map_or(443, i64::from))
            && str_at(webhook_port, "/targetPort") == "webhook",
        "the Service's webhook port does not lead to the container's: {webhook_port}"
    );
    Ok((config, secret))
}

#[test]
fn shipped_sharder_configs_are_valid_and_fit_the_deployment() -> anyhow::Result<()> {
    let (base, _) = check_sharder_install(&render("config/sharder")?)?;
    // Every install below equals the base but for its own field, so all serve metrics securely.
    ensure!(
        base.metrics.secure,
        "the shipped config serves metrics insecurely"
    );
    assert!(base.webhook.config.annotations.is_empty());
    assert_eq!(base.webhook.config.client_config.ca_bundle_file, None);

    // With cert-manager: the base config plus the CA-injection annotation naming the Certificate
    // that fills the mounted Secret.
    let default = render("config/default")?;
    let (with_cert_manager, secret) = check_sharder_install(&default)?;
    let certificate = only(&default, "Certificate")?;
    ensure!(
        str_at(certificate, "/spec/secretName") == secret,
        "the Certificate does not fill the mounted Secret {secret}"
    );
    let dns_names = certificate["spec"]["dnsNames"].to_string();
    ensure!(
        dns_names.contains("\"sharder.sharding-system.svc\""),
        "Certificate dnsNames {dns_names}"
    );
    let issuer = only(&default, "Issuer")?;
    ensure!(str_at(certificate, "/spec/issuerRef/name") == name(issuer));
    let mut expected = base.clone();
    expected.webhook.config.annotations.insert(
        "cert-manager.io/inject-ca-from".into(),
        format!("{}/{}", namespace(certificate), name(certificate)),
    );
    assert_eq!(with_cert_manager, expected);

    // Without cert-manager: the base config plus the CA file from the mounted Secret.
    let (without_cert_manager, _) =
        check_sharder_install(&render("config/overlays/no-cert-manager")?)?;
    let mut expected = base;
    expected.webhook.config.client_config.ca_bundle_file =
        Some(expected.webhook.server.cert_dir.join("ca.crt"));
    assert_eq!(without_cert_manager, expected);
    Ok(())
}

#[test]
fn sharder_cluster_role_is_exactly_the_spec_list() -> anyhow::Result<()> {
    let objects = render("config/rbac")?;
    let expected = expected_grants(&[
        (&["events.k8s.io"], "events", &["create"]),
        (&[""], "namespaces", &["list", "watch"]),
        (
            &["admissionregistration.k8s.io"],
            "mutatingwebhookconfigurations",
            &["create", "patch", "get", "list", "watch", "delete"],
        ),
        (
            &["coordination.k8s.io"],
            "leases",
            &["list", "watch", "patch", "delete"],
        ),
        // `use`: what the shard Lease policies ask of takeovers, exclusions and deletes.
        (
            &["sharding.timebertt.dev"],
            "clusterrings",
            &["list", "watch", "use"],
        ),
        (
            &["sharding.timebertt.dev"],
            "controllerrings",
            &["list", "watch", "use"],
        ),
        (
            &["sharding.timebertt.dev"],
            "clusterrings/status",
            &["patch"],
        ),
        (
            &["sharding.timebertt.dev"],
            "controllerrings/status",
            &["patch"],
        ),
        (
            &["sharding.timebertt.dev"],
            "clusterrings/finalizers",
            &["update"],
        ),
        (
            &["sharding.timebertt.dev"],
            "controllerrings/finalizers",
            &["update"],
        ),
        // Reviews of metrics scrapers (metrics.secure).
        (&["authentication.k8s.io"], "tokenreviews", &["create"]),
        (
            &["authorization.k8s.io"],
            "subjectaccessreviews",
            &["create"],
        ),
    ]);
    let role = find(&objects, "ClusterRole", "sharding:sharder")?;
    assert_eq!(grants(role)?, expected);

    let leader_election = only(&objects, "Role")?;
    assert_eq!(namespace(leader_election), SYSTEM_NAMESPACE);
    assert_eq!(
        grants(leader_election)?,
        expected_grants(&[(
            &["coordination.k8s.io"],
            "leases",
            &["get", "create", "update"],
        )])
    );

    let service_account = only(&objects, "ServiceAccount")?;
    assert_eq!(
        (namespace(service_account), name(service_account)),
        (SYSTEM_NAMESPACE, SHARDER)
    );
    ensure!(
        binds(
            only(&objects, "ClusterRoleBinding")?,
            "ClusterRole",
            "sharding:sharder",
            SYSTEM_NAMESPACE,
            SHARDER
        ),
        "the ClusterRole is not bound to the sharder"
    );
    let binding = only(&objects, "RoleBinding")?;
    ensure!(
        namespace(binding) == SYSTEM_NAMESPACE
            && binds(
                binding,
                "Role",
                name(leader_election),
                SYSTEM_NAMESPACE,
                SHARDER
            ),
        "the leader-election Role is not bound to the sharder"
    );

    let sharder = render("config/sharder")?;
    let deployment = find(&sharder, "Deployment", SHARDER)?;
    assert_eq!(
        str_at(deployment, "/spec/template/spec/serviceAccountName"),
        SHARDER
    );
    Ok(())
}

/// The shipped metrics-reader ClusterRole grants `get` on `/metrics` and nothing else.
#[test]
fn metrics_reader_grants_only_get_on_metrics() -> anyhow::Result<()> {
    let objects = render("config/rbac")?;
    let role = find(&objects, "ClusterRole", METRICS_READER)?;
    assert_eq!(
        role["rules"],
        json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}])
    );
    // The end-to-end tests bind the same file's role.
    ensure!(
        shipped_metrics_reader()?
            .rules
            .is_some_and(|r| r.len() == 1)
    );
    // Scrapers bind it themselves: nothing shipped names their ServiceAccount.
    ensure!(
        !objects
            .iter()
            .any(|o| str_at(o, "/roleRef/name") == METRICS_READER),
        "config/rbac binds {METRICS_READER}"
    );
    Ok(())
}

/// The ServiceMonitor scrapes what the sharder serves: a port the Service and the container have,
/// HTTPS with the scraper's ServiceAccount token (the shipped config is secure), the server's
/// certificate verified against the CA of the mounted Secret, for a name the certificate holds.
#[test]
fn service_monitor_scrapes_the_secure_metrics() -> anyhow::Result<()> {
    let default = render("config/default")?;
    let (config, secret) = check_sharder_install(&default)?;
    ensure!(
        config.metrics.secure,
        "the installed sharder serves plain metrics"
    );
    let monitoring = render("config/monitoring")?;
    let monitor = only(&monitoring, "ServiceMonitor")?;
    let endpoints = monitor["spec"]["endpoints"]
        .as_array()
        .context("no endpoints")?;
    ensure!(endpoints.len() == 1, "expected one endpoint");
    let endpoint = &endpoints[0];

    let port_name = str_at(endpoint, "/port");
    let service = find(&default, "Service", SHARDER)?;
    let service_port = service["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| str_at(p, "/name") == port_name)
        .with_context(|| format!("the Service has no port {port_name}"))?;
    let container = container(find(&default, "Deployment", SHARDER)?, SHARDER)?;
    ensure!(
        container_port(container, str_at(service_port, "/targetPort"))
            == bind_port(&config.metrics.bind_address)?,
        "the Service's {port_name} port does not lead to the metrics address"
    );
    for (key, value) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("no selector")?
    {
        ensure!(
            &service["metadata"]["labels"][key] == value,
            "the ServiceMonitor selects {key}={value}, the Service does not carry it"
        );
    }

    assert_eq!(str_at(endpoint, "/path"), "/metrics");
    assert_eq!(str_at(endpoint, "/scheme"), "https");
    assert_eq!(
        str_at(endpoint, "/bearerTokenFile"),
        "/var/run/secrets/kubernetes.io/serviceaccount/token"
    );
    let tls = &endpoint["tlsConfig"];
    ensure!(
        tls.get("insecureSkipVerify").is_none_or(|v| v == false),
        "the ServiceMonitor skips certificate verification"
    );
    assert_eq!(str_at(tls, "/ca/secret/name"), secret);
    assert_eq!(str_at(tls, "/ca/secret/key"), "ca.crt");
    let certificate = only(&default, "Certificate")?;
    let server_name = str_at(tls, "/serverName");
    ensure!(
        certificate["spec"]["dnsNames"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n == server_name),
        "serverName {server_name} is not a name of the serving certificate"
    );
    assert_eq!(namespace(monitor), namespace(service));
    Ok(())
}

/// docs/protocol.md §14: per ring, the sharder may list and patch every main and controlled
/// resource (and watch them, for assigning objects the webhook missed), through
/// `sharding:clusterring:<ring>`.
#[test]
fn example_ring_grants_the_sharder_its_resources() -> anyhow::Result<()> {
    for (dir, ring_kind, other) in [
        ("deploy", "ClusterRing", "ControllerRing"),
        ("deploy/controllerring", "ControllerRing", "ClusterRing"),
    ] {
        let objects = render(dir)?;
        ensure!(
            !objects.iter().any(|o| kind(o) == other),
            "{dir} has a {other}"
        );
        example_grants(&objects, ring_kind)?;
    }
    let shards = render("deploy/controllerring")?;
    let args = &container(
        find(&shards, "Deployment", "checksum-controller")?,
        "checksum-controller",
    )?["args"];
    ensure!(
        args.as_array()
            .is_some_and(|a| a.iter().any(|v| v == "--ring-kind=ControllerRing")),
        "the ControllerRing example's shards do not join a ControllerRing: {args}"
    );
    Ok(())
}

fn example_grants(objects: &[Value], ring_kind: &str) -> anyhow::Result<()> {
    let ring = only(objects, ring_kind)?;
    let role_name = format!("sharding:clusterring:{}", name(ring));
    let granted = grants(find(objects, "ClusterRole", &role_name)?)?;
    ensure!(
        objects.iter().any(|o| kind(o) == "ClusterRoleBinding"
            && binds(o, "ClusterRole", &role_name, SYSTEM_NAMESPACE, SHARDER)),
        "{role_name} is not bound to the sharder"
    );

    let mut needed: BTreeSet<(String, String)> = BTreeSet::new();
    for resource in ring["spec"]["resources"].as_array().into_iter().flatten() {
        needed.insert((
            str_at(resource, "/group").into(),
            str_at(resource, "/resource").into(),
        ));
        for controlled in resource["controlledResources"]
            .as_array()
            .into_iter()
            .flatten()
        {
            needed.insert((
                str_at(controlled, "/group").into(),
                str_at(controlled, "/resource").into(),
            ));
        }
    }
    ensure!(!needed.is_empty(), "the example ring has no resources");
    for (group, resource) in &needed {
        for verb in ["get", "list", "watch", "patch"] {
            ensure!(
                granted.contains(&(group.clone(), resource.clone(), verb.into())),
                "{role_name} lacks {verb} on {group}/{resource}"
            );
        }
    }
    Ok(())
}

/// Whether `object` is a ValidatingAdmissionPolicy or a binding of one.
pub(crate) fn is_admission_policy(object: &Value) -> bool {
    str_at(object, "/apiVersion") == "admissionregistration.k8s.io/v1"
        && kind(object).starts_with("ValidatingAdmissionPolicy")
}

/// The installs a user follows (`config/default`, `config/overlays/no-cert-manager`) contain every
/// object of `config/admission-policies` unchanged; their Kubernetes 1.29 variants contain none
/// of them and are otherwise the same install.
#[test]
fn installs_include_the_admission_policies_except_on_1_29() -> anyhow::Result<()> {
    let policies = render("config/admission-policies")?;
    ensure!(
        policies.len() == 6 && policies.iter().all(is_admission_policy),
        "config/admission-policies should hold three policies and their bindings"
    );
    for (install, for_1_29) in [
        ("config/default", "config/overlays/k8s-1.29/default"),
        (
            "config/overlays/no-cert-manager",
            "config/overlays/k8s-1.29/no-cert-manager",
        ),
    ] {
        let objects = render(install)?;
        for policy in &policies {
            let found = objects
                .iter()
                .find(|o| kind(o) == kind(policy) && name(o) == name(policy))
                .with_context(|| format!("{install} lacks {}", describe(policy)))?;
            ensure!(
                found["spec"] == policy["spec"],
                "{install} changes {}",
                describe(policy)
            );
        }
        let old = render(for_1_29)?;
        ensure!(
            !old.iter().any(is_admission_policy),
            "{for_1_29} includes an admission policy"
        );
        let rest: Vec<&Value> = objects.iter().filter(|o| !is_admission_policy(o)).collect();
        let old: Vec<&Value> = old.iter().collect();
        ensure!(
            rest == old,
            "{for_1_29} is not {install} without the admission policies"
        );
    }
    Ok(())
}

/// Both example rings take shards only from Leases in the namespace their shards run in and
/// write their Leases to (`--lease-namespace=$(POD_NAMESPACE)`).
#[test]
fn example_rings_take_shards_only_from_their_namespace() -> anyhow::Result<()> {
    for (dir, ring_kind) in [
        ("deploy", "ClusterRing"),
        ("deploy/controllerring", "ControllerRing"),
    ] {
        let objects = render(dir)?;
        let deployment = find(&objects, "Deployment", "checksum-controller")?;
        let shards = container(deployment, "checksum-controller")?;
        ensure!(
            shards["args"]
                .as_array()
                .is_some_and(|a| a.iter().any(|v| v == "--lease-namespace=$(POD_NAMESPACE)")),
            "{dir}: the shards do not write their Leases into their own namespace"
        );
        let ring = only(&objects, ring_kind)?;
        assert_eq!(
            ring["spec"]["leaseNamespaces"],
            json!([namespace(deployment)]),
            "{dir}: spec.leaseNamespaces"
        );
    }
    Ok(())
}

/// `deploy/statefulset` is `deploy/` with the shards' Deployment replaced by a StatefulSet of the
/// same pods, whose shards keep their Leases over a restart (`--on-shutdown=keep-if-returning`)
/// and may read that StatefulSet (and no other), with a grace period above the shutdown's bounds
/// (the renew deadline for the work, 5 s for the read).
#[test]
fn statefulset_example_is_the_example_with_a_statefulset() -> anyhow::Result<()> {
    let example = render("deploy")?;
    let variant = render("deploy/statefulset")?;
    let deployment = find(&example, "Deployment", "checksum-controller")?;
    ensure!(
        !variant.iter().any(|o| kind(o) == "Deployment"),
        "deploy/statefulset keeps a Deployment"
    );
    for object in example.iter().filter(|o| kind(o) != "Deployment") {
        ensure!(
            variant.contains(object),
            "deploy/statefulset lacks or changes {}",
            describe(object)
        );
    }
    let statefulset = only(&variant, "StatefulSet")?;
    ensure!(namespace(statefulset) == namespace(deployment), "namespace");
    ensure!(
        statefulset["spec"]["selector"] == deployment["spec"]["selector"]
            && statefulset["spec"]["template"]["metadata"]
                == deployment["spec"]["template"]["metadata"],
        "the StatefulSet's pods are not the Deployment's"
    );
    ensure!(
        str_at(statefulset, "/spec/podManagementPolicy") == "Parallel",
        "podManagementPolicy"
    );
    let grace = statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap_or(30);
    ensure!(grace > 10 + 5, "terminationGracePeriodSeconds {grace}");
    let args = container(statefulset, "checksum-controller")?["args"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut expected = container(deployment, "checksum-controller")?["args"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    expected.push(json!("--on-shutdown=keep-if-returning"));
    let sorted = |mut v: Vec<Value>| {
        v.sort_by_key(Value::to_string);
        v
    };
    ensure!(
        sorted(args.clone()) == sorted(expected),
        "the StatefulSet's shards run with {args:?}"
    );
    // `get` on its own StatefulSet, in the shards' namespace, for the shards' ServiceAccount.
    let account = str_at(statefulset, "/spec/template/spec/serviceAccountName");
    let roles: Vec<&Value> = variant
        .iter()
        .filter(|o| kind(o) == "Role" && namespace(o) == namespace(statefulset))
        .filter(|role| {
            role["rules"].as_array().into_iter().flatten().any(|rule| {
                rule["apiGroups"] == json!(["apps"])
                    && rule["resources"] == json!(["statefulsets"])
                    && rule["resourceNames"] == json!([name(statefulset)])
                    && rule["verbs"] == json!(["get"])
            })
        })
        .collect();
    ensure!(
        roles
            .iter()
            .any(|role| variant.iter().any(|o| kind(o) == "RoleBinding"
                && namespace(o) == namespace(statefulset)
                && binds(o, "Role", name(role), namespace(statefulset), account))),
        "the shards may not get their StatefulSet"
    );
    Ok(())
}
