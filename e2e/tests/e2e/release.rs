//! The release bundle (`release.sh`, `dist/`) and the Helm chart (`charts/kube-sharding`): the
//! committed files are exactly what the script renders from the kustomize sources today, each
//! bundle file is the install it claims to be, the chart passes `helm lint`, and `helm template`
//! for a matrix of values puts each value where it belongs and passes a server-side dry run
//! against the real API server. `helm` is built and cached by `e2e/helm.sh`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail, ensure};
use e2e::cluster;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams};
use kube_sharding_api::config::SharderConfig;
use serde_json::Value;

use crate::manifests::{
    create_missing_namespaces, dry_run, install_foreign_crds, is_admission_policy, kind, name,
    parse_documents, render, str_at, workspace_root,
};

const CHART: &str = "charts/kube-sharding";
/// The namespace the chart must be installed into.
const SYSTEM: &str = "sharding-system";

/// The committed YAML files of `dist/`, each with the kustomization release.sh renders it from.
const BUNDLE: &[(&str, &str)] = &[
    ("install.yaml", "config/release/install"),
    (
        "install-cert-manager.yaml",
        "config/release/install-cert-manager",
    ),
    ("admission-policies.yaml", "config/admission-policies"),
    ("example.yaml", "deploy"),
    ("example-statefulset.yaml", "deploy/statefulset"),
    ("external-metrics.yaml", "config/external-metrics"),
    ("example-autoscaling.yaml", "deploy/autoscaling"),
];

/// Runs `release.sh` with `args` and the tests' kubectl; its standard error.
fn release_sh(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("bash")
        .arg(workspace_root().join("release.sh"))
        .args(args)
        .env("KUBECTL", e2e::kubectl())
        .current_dir(workspace_root())
        .output()
        .context("failed to run release.sh")?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    ensure!(out.status.success(), "release.sh failed: {stderr}");
    Ok(stderr)
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("failed to read {}", path.display()))
}

/// CI's drift check: rendering again gives the committed files byte for byte, and SHA256SUMS
/// covers each of them.
#[test]
fn committed_bundle_is_what_the_sources_render() -> anyhow::Result<()> {
    let out = std::env::temp_dir().join(e2e::unique_name("dist"));
    release_sh(&["--out", out.to_str().context("temp dir is not UTF-8")?])?;
    let mut stale = Vec::new();
    for (file, _) in BUNDLE {
        if read(&out.join(file))? != read(&workspace_root().join("dist").join(file))? {
            stale.push(format!("dist/{file}"));
        }
    }
    let rendered = files_under(&out.join("chart"))?;
    let committed = files_under(&workspace_root().join(CHART))?;
    for path in rendered.keys().chain(committed.keys()) {
        if rendered.get(path) != committed.get(path) {
            stale.push(format!("{CHART}/{path}"));
        }
    }
    let sums = read(&out.join("SHA256SUMS"))?;
    let _ = std::fs::remove_dir_all(&out);
    stale.dedup();
    ensure!(
        stale.is_empty(),
        "{stale:?} differ from what the sources render: run ./release.sh and commit the result"
    );
    for (file, _) in BUNDLE {
        ensure!(
            sums.lines().any(|l| l.ends_with(&format!("  {file}"))),
            "SHA256SUMS does not cover {file}:\n{sums}"
        );
    }
    Ok(())
}

/// What each file holds: install.yaml is the no-cert-manager install with the NetworkPolicy and
/// without the admission policies, install-cert-manager.yaml the same for config/default, and
/// the policies are their own file, unchanged.
#[test]
fn bundle_files_are_the_installs_they_name() -> anyhow::Result<()> {
    let dist = |file: &str| -> anyhow::Result<Vec<Value>> {
        let path = workspace_root().join("dist").join(file);
        parse_documents(&read(&path)?, file)
    };
    for (file, full) in [
        ("install.yaml", "config/overlays/no-cert-manager"),
        ("install-cert-manager.yaml", "config/default"),
    ] {
        let objects = dist(file)?;
        ensure!(
            !objects.iter().any(is_admission_policy),
            "{file} holds an admission policy: they belong in admission-policies.yaml"
        );
        let (policies, mut others): (Vec<Value>, Vec<Value>) =
            render(full)?.into_iter().partition(is_admission_policy);
        ensure!(!policies.is_empty(), "{full} has no admission policies");
        let mut ours: Vec<Value> = objects
            .into_iter()
            .filter(|o| kind(o) != "NetworkPolicy")
            .collect();
        let key = |o: &Value| format!("{}/{}", kind(o), name(o));
        ours.sort_by_key(key);
        others.sort_by_key(key);
        ensure!(
            ours == others,
            "{file} is not {full} without its admission policies"
        );
        ensure!(
            dist(file)?
                .iter()
                .any(|o| kind(o) == "NetworkPolicy" && name(o) == "sharder"),
            "{file} lacks the sharder's NetworkPolicy"
        );
    }
    ensure!(
        dist("admission-policies.yaml")? == render("config/admission-policies")?,
        "admission-policies.yaml is not config/admission-policies"
    );
    ensure!(
        dist("example.yaml")? == render("deploy")?,
        "example.yaml is not deploy/"
    );
    Ok(())
}

/// The list above names every kustomization release.sh renders, so none escapes the checks.
#[test]
fn bundle_list_matches_the_script() -> anyhow::Result<()> {
    let script = read(&workspace_root().join("release.sh"))?;
    let rendered: Vec<(String, String)> = script
        .lines()
        .filter_map(|l| l.strip_prefix("render "))
        .filter_map(|l| l.split_once(' '))
        .map(|(source, file)| (file.to_string(), source.to_string()))
        .collect();
    let listed: Vec<(String, String)> = BUNDLE
        .iter()
        .map(|(f, s)| (f.to_string(), s.to_string()))
        .collect();
    ensure!(
        rendered == listed,
        "release.sh renders {rendered:?}, the test knows {listed:?}"
    );
    Ok(())
}

/// Every file under `dir` by its path relative to `dir`, with its content.
fn files_under(dir: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<String, String>) -> anyhow::Result<()> {
        for entry in std::fs::read_dir(dir).with_context(|| format!("no {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                walk(base, &path, out)?;
            } else {
                let relative = path.strip_prefix(base)?.to_string_lossy().into_owned();
                out.insert(relative, read(&path)?);
            }
        }
        Ok(())
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out)?;
    Ok(out)
}

/// The Kubernetes version helm renders for: the test control plane's (`KUBE_VERSION` of
/// e2e/control-plane.sh).
fn kube_version() -> String {
    std::env::var("KUBE_VERSION").unwrap_or_else(|_| "1.37.2".to_string())
}

/// Runs helm with `args` in the workspace root; its standard output.
fn run_helm(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(e2e::helm::binary()?)
        .args(args)
        .current_dir(workspace_root())
        .output()
        .context("failed to run helm")?;
    if !out.status.success() {
        bail!(
            "helm {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// The objects `helm template` renders for the chart with `sets` (`--set` arguments), for the
/// test control plane's Kubernetes version.
fn helm_template(sets: &[&str]) -> anyhow::Result<Vec<Value>> {
    let version = kube_version();
    let mut args = vec![
        "template",
        "kube-sharding",
        CHART,
        "--namespace",
        SYSTEM,
        "--kube-version",
        &version,
    ];
    for set in sets {
        args.extend(["--set", set]);
    }
    let text = run_helm(&args)?;
    Ok(parse_documents(&text, "helm template")?
        .into_iter()
        .filter(|o| !o.is_null())
        .collect())
}

fn object<'a>(objects: &'a [Value], kind_: &str, name_: &str) -> anyhow::Result<&'a Value> {
    objects
        .iter()
        .find(|o| kind(o) == kind_ && name(o) == name_)
        .with_context(|| format!("no {kind_} {name_}"))
}

/// The SharderConfig of a render, parsed as the sharder parses it.
fn chart_config(objects: &[Value]) -> anyhow::Result<(SharderConfig, Value)> {
    let text = str_at(
        object(objects, "ConfigMap", "sharder-config")?,
        "/data/config.yaml",
    );
    let config = SharderConfig::from_yaml(text).context("the chart's SharderConfig")?;
    Ok((config, serde_yaml::from_str(text)?))
}

#[test]
fn chart_passes_helm_lint() -> anyhow::Result<()> {
    let version = kube_version();
    let out = run_helm(&[
        "lint",
        CHART,
        "--strict",
        "--namespace",
        SYSTEM,
        "--kube-version",
        &version,
    ])?;
    ensure!(out.contains("0 chart(s) failed"), "helm lint: {out}");
    // Anywhere else the chart refuses to render (its names are fixed).
    let elsewhere = run_helm(&[
        "template",
        "x",
        CHART,
        "--namespace",
        "other",
        "--kube-version",
        &version,
    ]);
    ensure!(
        elsewhere.is_err_and(|e| format!("{e:#}").contains("namespace sharding-system")),
        "the chart rendered for a namespace other than sharding-system"
    );
    Ok(())
}

/// With default values the chart installs what dist/install.yaml does (less the Namespace,
/// which Helm creates, plus the self-signed certificate's Secret) and the admission policies,
/// with the same SharderConfig.
#[test]
fn chart_defaults_are_the_release_bundle() -> anyhow::Result<()> {
    let chart = helm_template(&[])?;
    let bundle = parse_documents(
        &read(&workspace_root().join("dist/install.yaml"))?,
        "install",
    )?;
    let policies = render("config/admission-policies")?;
    for expected in bundle.iter().chain(&policies) {
        match kind(expected) {
            "Namespace" => continue,
            "ConfigMap" => {
                let ours = chart_config(&chart)?.1;
                let theirs: Value = serde_yaml::from_str(str_at(expected, "/data/config.yaml"))?;
                ensure!(ours == theirs, "SharderConfig {ours} is not {theirs}");
            }
            kind_ => {
                let mut found = object(&chart, kind_, name(expected))?.clone();
                if kind_ == "Deployment" {
                    let annotations = found["spec"]["template"]["metadata"]
                        .as_object_mut()
                        .and_then(|m| m.remove("annotations"));
                    ensure!(
                        annotations.is_some_and(|a| a.get("checksum/config").is_some()),
                        "the Deployment's pods carry no checksum of the configuration"
                    );
                }
                ensure!(
                    &found == expected,
                    "the chart's {kind_} {} differs from the bundle's:\n{found}\n{expected}",
                    name(expected)
                );
            }
        }
    }
    let secret = object(&chart, "Secret", "sharder-webhook-tls")?;
    for key in ["ca.crt", "tls.crt", "tls.key"] {
        ensure!(
            !str_at(secret, &format!("/data/{key}")).is_empty(),
            "the self-signed Secret lacks {key}"
        );
    }
    // The bundle's Namespace out, the Secret in: as many objects as the bundle and the policies.
    ensure!(
        chart.len() == bundle.len() + policies.len(),
        "the chart renders {} objects, the bundle and policies {}",
        chart.len(),
        bundle.len() + policies.len()
    );
    Ok(())
}

/// One `helm template` of the matrix: its `--set`s and what must hold of the result.
struct Case {
    sets: &'static [&'static str],
    check: fn(&[Value]) -> anyhow::Result<()>,
}

fn deployment(objects: &[Value]) -> anyhow::Result<&Value> {
    object(objects, "Deployment", "sharder")
}

fn count(objects: &[Value], kind_: &str) -> usize {
    objects.iter().filter(|o| kind(o) == kind_).count()
}

const MATRIX: &[Case] = &[
    Case {
        sets: &[],
        check: |objects| {
            ensure!(count(objects, "ValidatingAdmissionPolicy") == 3, "policies");
            ensure!(count(objects, "NetworkPolicy") == 1, "network policy");
            ensure!(count(objects, "Certificate") == 0, "certificate");
            ensure!(count(objects, "ServiceMonitor") == 0, "service monitor");
            ensure!(
                count(objects, "APIService") == 0,
                "external metrics on by default"
            );
            let (config, _) = chart_config(objects)?;
            ensure!(config.metrics.secure, "metrics not secure by default");
            Ok(())
        },
    },
    // The external metrics API with the self-signed certificate: the APIService trusts its CA.
    Case {
        sets: &["externalMetrics.enabled=true"],
        check: |objects| {
            let api = object(objects, "APIService", "v1beta1.external.metrics.k8s.io")?;
            let secret = object(objects, "Secret", "sharder-webhook-tls")?;
            ensure!(
                str_at(api, "/spec/caBundle") == str_at(secret, "/data/ca.crt"),
                "the APIService's CA bundle is not the self-signed CA"
            );
            object(objects, "ClusterRole", "sharding:external-metrics-reader")?;
            object(
                objects,
                "RoleBinding",
                "sharding:sharder:extension-apiserver-authentication-reader",
            )?;
            Ok(())
        },
    },
    // cert-manager, a ServiceMonitor, the alerts and the external metrics on; everything else the
    // defaults.
    Case {
        sets: &[
            "certManager.enabled=true",
            "serviceMonitor.enabled=true",
            "prometheusRule.enabled=true",
            "externalMetrics.enabled=true",
        ],
        check: |objects| {
            let api = object(objects, "APIService", "v1beta1.external.metrics.k8s.io")?;
            ensure!(
                api["spec"]["caBundle"].is_null()
                    && api["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
                        == "sharding-system/sharder-webhook",
                "the APIService's CA is not cert-manager's: {api}"
            );
            ensure!(
                count(objects, "Secret") == 0,
                "a Secret beside cert-manager"
            );
            object(objects, "Certificate", "sharder-webhook")?;
            ensure!(count(objects, "Issuer") == 1, "no Issuer");
            let (config, _) = chart_config(objects)?;
            ensure!(
                config
                    .webhook
                    .config
                    .annotations
                    .contains_key("cert-manager.io/inject-ca-from"),
                "no CA injection with cert-manager"
            );
            let monitor = object(objects, "ServiceMonitor", "sharder")?;
            ensure!(
                monitor["spec"]["endpoints"][0]["scheme"] == "https",
                "{monitor}"
            );
            let rules = objects
                .iter()
                .find(|o| kind(o) == "PrometheusRule")
                .context("no PrometheusRule")?;
            ensure!(
                rules.to_string().contains("{{ $labels"),
                "the alert templates did not come out as written"
            );
            Ok(())
        },
    },
    // Everything optional off, insecure metrics scraped over HTTP.
    Case {
        sets: &[
            "admissionPolicies.enabled=false",
            "networkPolicy.enabled=false",
            "metrics.secure=false",
            "serviceMonitor.enabled=true",
            "webhookCertificate.selfSigned=false",
        ],
        check: |objects| {
            for kind_ in ["ValidatingAdmissionPolicy", "NetworkPolicy", "Secret"] {
                ensure!(count(objects, kind_) == 0, "{kind_} rendered");
            }
            ensure!(!chart_config(objects)?.0.metrics.secure, "metrics secure");
            let endpoint = &object(objects, "ServiceMonitor", "sharder")?["spec"]["endpoints"][0];
            ensure!(
                endpoint["scheme"] == "http"
                    && endpoint["tlsConfig"].is_null()
                    && endpoint["bearerTokenFile"].is_null(),
                "{endpoint}"
            );
            Ok(())
        },
    },
    // The pod's placement, size and image, and the configuration.
    Case {
        sets: &[
            "replicas=3",
            "image.repository=registry.invalid/sharder",
            "image.digest=sha256:0000000000000000000000000000000000000000000000000000000000000000",
            "resources.requests.cpu=250m",
            "nodeSelector.kubernetes\\.io/os=linux",
            "tolerations[0].key=dedicated,tolerations[0].operator=Exists",
            "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=kubernetes.io/arch,affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
            "priorityClassName=system-cluster-critical",
            "config.controller.sharder.syncPeriod=1m",
            "config.metrics.tokenAudiences[0]=sharder",
            "networkPolicy.metricsNamespace=prometheus",
            "crds.keep=true",
        ],
        check: |objects| {
            let d = deployment(objects)?;
            let pod = &d["spec"]["template"]["spec"];
            ensure!(d["spec"]["replicas"] == 3, "replicas");
            ensure!(
                pod["containers"][0]["image"]
                    == "registry.invalid/sharder@sha256:0000000000000000000000000000000000000000000000000000000000000000",
                "image {}",
                pod["containers"][0]["image"]
            );
            ensure!(
                pod["containers"][0]["resources"]["requests"]["cpu"] == "250m"
                    && pod["containers"][0]["resources"]["limits"]["memory"] == "256Mi",
                "resources {}",
                pod["containers"][0]["resources"]
            );
            ensure!(
                pod["nodeSelector"]["kubernetes.io/os"] == "linux",
                "nodeSelector"
            );
            ensure!(pod["tolerations"][0]["key"] == "dedicated", "tolerations");
            ensure!(pod["affinity"]["nodeAffinity"].is_object(), "affinity");
            ensure!(
                pod["priorityClassName"] == "system-cluster-critical",
                "priority"
            );
            let (config, _) = chart_config(objects)?;
            ensure!(
                config.controller.sharder.sync_period.0 == std::time::Duration::from_secs(60),
                "syncPeriod"
            );
            ensure!(
                config.metrics.token_audiences == ["sharder"],
                "tokenAudiences"
            );
            // The rest of the generated configuration stays.
            ensure!(
                config.webhook.config.client_config.ca_bundle_file.is_some(),
                "CA file"
            );
            let policy = object(objects, "NetworkPolicy", "sharder")?;
            ensure!(
                policy
                    .to_string()
                    .contains("\"kubernetes.io/metadata.name\":\"prometheus\""),
                "{policy}"
            );
            for crd in objects
                .iter()
                .filter(|o| kind(o) == "CustomResourceDefinition")
            {
                ensure!(
                    crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep",
                    "{} not kept",
                    name(crd)
                );
            }
            Ok(())
        },
    },
];

/// The values matrix: each render puts its values where they belong, and the API server accepts
/// every object (server-side dry run; cert-manager's and the Prometheus Operator's kinds against
/// stand-in CRDs, as in the manifests test).
#[tokio::test]
async fn chart_values_matrix_passes_server_side_dry_run() -> anyhow::Result<()> {
    let cluster = cluster();
    let client = cluster.client().await?;
    let foreign = install_foreign_crds(&client, cluster.state_dir().is_some()).await?;
    let policies_served =
        e2e::serves_admission_policies(cluster, "the chart's admission policies")?;
    let mut rendered = Vec::new();
    for case in MATRIX {
        let objects = helm_template(case.sets)?;
        (case.check)(&objects).with_context(|| format!("values {:?}", case.sets))?;
        rendered.push((case.sets, objects));
    }
    let named: Vec<(&str, Vec<Value>)> = rendered
        .iter()
        .map(|(_, objects)| ("chart", objects.clone()))
        .collect();
    let created = create_missing_namespaces(&client, &named).await?;
    let mut failures = Vec::new();
    for (sets, objects) in rendered {
        let items: Vec<Value> = objects
            .into_iter()
            .filter(|o| {
                let api = str_at(o, "/apiVersion");
                let foreign_kind = api.starts_with("cert-manager.io/")
                    || api.starts_with("monitoring.coreos.com/");
                (!foreign_kind || foreign.contains(kind(o)))
                    && (policies_served || !is_admission_policy(o))
            })
            .collect();
        if let Err(error) = dry_run(cluster.kubeconfig(), &format!("chart {sets:?}"), items) {
            failures.push(format!("{error:#}"));
        }
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for name in created {
        let _ = namespaces.delete(&name, &DeleteParams::default()).await;
    }
    ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}
