//! The sharder's external metrics API (docs/autoscaling.md) called directly as the API server's
//! aggregation layer calls it: with a client certificate of the control plane's front-proxy CA
//! and the user in `X-Remote-*` headers. The sharder reads the CA and the allowed names from the
//! ConfigMap the API server publishes, with the RBAC of `config/external-metrics`, and asks the
//! API server whether the user may read the metric. The values are summed from load reports the
//! test writes on shard Leases, as shards do.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use e2e::fixtures::create_annotated_lease;
use e2e::net::curl;
use e2e::process::poll_until;
use e2e::scenario::SharedScenario;
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use kube::api::{Api, ObjectMeta, PostParams};
use kube_sharding_api::load::ANNOTATION_LOAD;
use kube_sharding_api::{RingKind, RingRef};
use serde_json::Value;

/// A client key and certificate with common name `cn`, signed by the CA `ca` (its key next to
/// it as `.key`), for client authentication; written into `dir` as `<name>.crt` and `.key`.
fn client_certificate(dir: &Path, name: &str, cn: &str, ca: &Path) -> anyhow::Result<PathBuf> {
    let key = dir.join(format!("{name}.key"));
    let csr = dir.join(format!("{name}.csr"));
    let crt = dir.join(format!("{name}.crt"));
    let ext = dir.join("client.ext");
    std::fs::write(&ext, "extendedKeyUsage=clientAuth\n")?;
    let run = |args: &[&str]| -> anyhow::Result<()> {
        let out = Command::new("openssl").args(args).output()?;
        ensure!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    };
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        &format!("/CN={cn}"),
        "-keyout",
        &key.display().to_string(),
        "-out",
        &csr.display().to_string(),
    ])?;
    run(&[
        "x509",
        "-req",
        "-in",
        &csr.display().to_string(),
        "-CA",
        &ca.display().to_string(),
        "-CAkey",
        &ca.with_extension("key").display().to_string(),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        &ext.display().to_string(),
        "-out",
        &crt.display().to_string(),
    ])?;
    Ok(crt)
}

/// The sharder's answer to GET `path` with the client certificate `cert` (none: `None`) and the
/// request headers `headers`: status and body.
fn get(
    base: &str,
    ca: &Path,
    cert: Option<&Path>,
    headers: &[(&str, &str)],
    path: &str,
) -> anyhow::Result<(u16, String)> {
    let mut args: Vec<String> = vec![
        "-sS".into(),
        "--cacert".into(),
        ca.display().to_string(),
        "-w".into(),
        "\n%{http_code}".into(),
    ];
    if let Some(cert) = cert {
        args.extend([
            "--cert".into(),
            cert.display().to_string(),
            "--key".into(),
            cert.with_extension("key").display().to_string(),
        ]);
    }
    for (name, value) in headers {
        args.extend(["-H".into(), format!("{name}: {value}")]);
    }
    args.push(format!("{base}{path}"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = curl(&args)?;
    let (text, code) = out.rsplit_once('\n').context("curl printed no status")?;
    Ok((code.trim().parse()?, text.to_owned()))
}

#[tokio::test]
async fn external_metrics_answer_front_proxy_users_allowed_to_read_them() -> anyhow::Result<()> {
    let SharedScenario {
        sharder,
        mut logs,
        cluster,
        client,
        ns,
    } = SharedScenario::in_namespace("extmetrics").await?;
    let Some(state) = cluster.state_dir() else {
        bail!(
            "this test needs the control plane's front-proxy CA: run it on a control plane e2e/control-plane.sh starts"
        );
    };
    let front_proxy_ca = state.join("front-proxy-ca.crt");
    let files = &sharder.files;
    let (base, ca) = (files.webhook_url(), files.ca.clone());
    // What config/external-metrics grants the sharder: reading the request-header settings.
    cluster.apply_yaml(&std::fs::read_to_string(
        e2e::in_cluster::workspace_root().join("config/external-metrics/rbac.yaml"),
    )?)?;

    let dir = tempdir()?;
    let proxy = client_certificate(&dir, "proxy", "front-proxy-client", &front_proxy_ca)?;
    // A certificate of the right name from another CA (the cluster's client CA), and one of the
    // front-proxy CA with a name the API server does not allow.
    let other_ca = client_certificate(
        &dir,
        "other-ca",
        "front-proxy-client",
        &state.join("ca.crt"),
    )?;
    let other_name = client_certificate(&dir, "other-name", "someone", &front_proxy_ca)?;

    // A ring of three shards: two report, the third reports nothing.
    let ring = RingRef::new(RingKind::ClusterRing, e2e::unique_name("extmetrics"));
    e2e::fixtures::create_ring(&client, &ring.name, e2e::fixtures::ring_spec(&ns)).await?;
    create_annotated_lease(
        &client,
        &ns,
        &ring,
        "shard-a",
        3600,
        [(ANNOTATION_LOAD, "objects=120,queue=3,p99ms=80")],
    )
    .await?;
    create_annotated_lease(
        &client,
        &ns,
        &ring,
        "shard-b",
        3600,
        [(ANNOTATION_LOAD, "objects=30,p99ms=250")],
    )
    .await?;
    create_annotated_lease(&client, &ns, &ring, "shard-c", 3600, []).await?;
    // The reader may read the metrics in the test's namespace, through the shipped ClusterRole.
    Api::<RoleBinding>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &RoleBinding {
                metadata: ObjectMeta {
                    name: Some("external-metrics-reader".into()),
                    ..ObjectMeta::default()
                },
                role_ref: RoleRef {
                    api_group: "rbac.authorization.k8s.io".into(),
                    kind: "ClusterRole".into(),
                    name: "sharding:external-metrics-reader".into(),
                },
                subjects: Some(vec![Subject {
                    kind: "Group".into(),
                    name: "metric-readers".into(),
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    ..Subject::default()
                }]),
            },
        )
        .await?;
    // config/external-metrics/rbac.yaml holds the ClusterRole: applied above.

    let objects = format!(
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/sharding-ring-objects?labelSelector=clusterring%3D{}",
        ring.name
    );
    let reader: &[(&str, &str)] = &[
        ("X-Remote-User", "reader"),
        ("X-Remote-Group", "metric-readers"),
    ];

    // The headers count only with a front proxy's certificate: without one, from another CA, or
    // with a name not allowed, 401.
    for cert in [None, Some(other_ca.as_path()), Some(other_name.as_path())] {
        let (status, body) = get(&base, &ca, cert, reader, &objects)?;
        assert_eq!(status, 401, "{cert:?}: {body}");
    }
    // A front proxy's request without a user is no one's: 401 as well.
    assert_eq!(get(&base, &ca, Some(&proxy), &[], &objects)?.0, 401);
    // A user the API server does not allow to read the metric: 403.
    let (status, body) = get(
        &base,
        &ca,
        Some(&proxy),
        &[("X-Remote-User", "stranger")],
        &objects,
    )?;
    assert_eq!(status, 403, "{body}");
    // The reader (allowed through its group) gets the ring's sum once the cache holds the Leases.
    let answer: Value = poll_until(
        "the sum of the ring's reports",
        Duration::from_secs(30),
        || {
            let got = get(&base, &ca, Some(&proxy), reader, &objects);
            async move {
                let (status, body) = got?;
                let answer: Value = serde_json::from_str(&body).with_context(|| body.clone())?;
                ensure!(status == 200, "{status}: {body}");
                Ok((answer["items"][0]["value"] == "150").then_some(answer))
            }
        },
    )
    .await?;
    assert_eq!(answer["kind"], "ExternalMetricValueList");
    assert_eq!(answer["items"][0]["metricName"], "sharding-ring-objects");
    assert_eq!(
        answer["items"][0]["metricLabels"]["clusterring"],
        ring.name.as_str()
    );
    // Queue depth: only shard-a reports one; p99: the highest.
    let value = |metric: &str, selector: &str| -> anyhow::Result<(u16, Value)> {
        let (status, body) = get(
            &base,
            &ca,
            Some(&proxy),
            reader,
            &format!("/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/{metric}{selector}"),
        )?;
        Ok((
            status,
            serde_json::from_str(&body).with_context(|| body.clone())?,
        ))
    };
    let selector = format!("?labelSelector=clusterring%3D{}", ring.name);
    let (status, v) = value("sharding-ring-queue-depth", &selector)?;
    assert_eq!((status, &v["items"][0]["value"]), (200, &Value::from("3")));
    let (status, v) = value("sharding-ring-p99-milliseconds", &selector)?;
    assert_eq!(
        (status, &v["items"][0]["value"]),
        (200, &Value::from("250"))
    );
    // The reader is allowed in its namespace only.
    let (status, _) = get(
        &base,
        &ca,
        Some(&proxy),
        reader,
        &objects.replace(&format!("/namespaces/{ns}/"), "/namespaces/default/"),
    )?;
    assert_eq!(status, 403);
    // No selector: 400; an unknown ring or metric: 404, as a Status.
    let (status, v) = value("sharding-ring-objects", "")?;
    assert_eq!((status, &v["kind"]), (400, &Value::from("Status")));
    let (status, v) = value(
        "sharding-ring-objects",
        "?labelSelector=clusterring%3Dno-such-ring",
    )?;
    assert_eq!((status, &v["reason"]), (404, &Value::from("NotFound")));
    // An unknown metric is 404 before any review.
    let (status, _) = value("no-such-metric", &selector)?;
    assert_eq!(status, 404);

    // When no available shard reports: an error, not 0. shard-a stops being available (its Lease
    // expires: released), shard-b's report goes; shard-c never reported.
    let leases = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), &ns);
    leases.delete("shard-a", &Default::default()).await?;
    leases
        .patch(
            "shard-b",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({
                "metadata": {"annotations": {ANNOTATION_LOAD: null}}
            })),
        )
        .await?;
    let last = poll_until(
        "a 503 once no shard reports",
        Duration::from_secs(30),
        || {
            let got = value("sharding-ring-objects", &selector);
            async move {
                let got = got?;
                Ok((got.0 == 503).then_some(got))
            }
        },
    )
    .await?;
    // The answer is an API Status, whose message says why.
    let answer: kube::core::Status = serde_json::from_value(last.1.clone())?;
    assert!(answer.message.contains("reports"), "{}", last.1);

    // Discovery needs a front proxy only.
    let (status, body) = get(
        &base,
        &ca,
        Some(&proxy),
        &[("X-Remote-User", "stranger")],
        "/apis/external.metrics.k8s.io/v1beta1",
    )?;
    assert_eq!(status, 200, "{body}");
    let list: Value = serde_json::from_str(&body)?;
    let names: Vec<&str> = list["resources"]
        .as_array()
        .context("resources")?
        .iter()
        .filter_map(|r| r["name"].as_str())
        .collect();
    assert_eq!(
        names,
        [
            "sharding-ring-objects",
            "sharding-ring-queue-depth",
            "sharding-ring-p99-milliseconds"
        ]
    );
    std::fs::remove_dir_all(&dir)?;
    logs.passed();
    Ok(())
}

/// A fresh directory for the test's keys and certificates.
fn tempdir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(e2e::unique_name("extmetrics-certs"));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
