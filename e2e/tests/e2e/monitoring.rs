//! The monitoring component (`config/monitoring`): its alerts pass `promtool check rules` and the
//! unit tests of `e2e/tests/monitoring/alerts_test.yaml`, every query of the Grafana dashboard
//! parses and the dashboard ships as the ConfigMap Grafana's sidecar loads, and a real Prometheus
//! server scraping a sharder's secure metrics (HTTPS, with a ServiceAccount token bound to the
//! shipped metrics reader) fires the "no available shard" alert when a ring loses its last shard
//! and resolves it when one returns.
//!
//! `promtool` and `prometheus` come from Debian's `prometheus` package, which `.ci/run` installs;
//! the variables `PROMTOOL` and `PROMETHEUS` name other binaries.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use e2e::fixtures::{create_lease, create_ring, ring_spec, wait_status};
use e2e::logs::DumpOnFailure;
use e2e::metrics_access::{bind_metrics_reader, install_metrics_reader, service_account_token};
use e2e::net::{curl, free_port};
use e2e::process::poll_until;
use e2e::scenario::DedicatedScenario;
use e2e::sharder_process::{SharderFiles, SharderSettings};
use e2e::unique_name;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams};
use kube_sharding_api::ClusterRing;
use serde_json::Value as Json;
use serde_yaml::Value as Yaml;

use crate::manifests::{render, workspace_root};

const RULE_FILE: &str = "config/monitoring/prometheus_rule.yaml";
const DASHBOARD_FILE: &str = "config/monitoring/controller-sharding-dashboard.json";
const ALERT_TESTS: &str = "e2e/tests/monitoring/alerts_test.yaml";
const NO_AVAILABLE_SHARD: &str = "ControllerShardingRingNoAvailableShard";

/// A tool of the `prometheus` package: `$<variable>` if set, else `name` on `PATH`. Fails with
/// what to install when it does not run.
fn tool(name: &str, variable: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::var_os(variable).map_or_else(|| PathBuf::from(name), PathBuf::from);
    let runs = Command::new(&path)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ensure!(
        runs,
        "{} does not run: install Debian's prometheus package (apt-get install prometheus; \
         .ci/run does), or set {variable}",
        path.display()
    );
    Ok(path)
}

/// Runs promtool with `args` in `dir`; fails with its output unless it succeeds.
fn promtool(dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(tool("promtool", "PROMTOOL")?)
        .args(args)
        .current_dir(dir)
        .output()
        .context("failed to run promtool")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "promtool {} failed:\n{text}",
        args.join(" ")
    );
    Ok(text)
}

/// A fresh directory under the system's temporary directory.
fn temp_dir(prefix: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(unique_name(prefix));
    std::fs::create_dir_all(&dir).with_context(|| format!("failed to create {}", dir.display()))?;
    Ok(dir)
}

/// The rule groups of the shipped PrometheusRule: its `spec`, which is exactly a Prometheus rule
/// file (`groups:`).
fn rule_groups() -> anyhow::Result<Yaml> {
    let text = std::fs::read_to_string(workspace_root().join(RULE_FILE))?;
    let rule: Yaml = serde_yaml::from_str(&text).context("the PrometheusRule is not YAML")?;
    ensure!(
        rule["kind"].as_str() == Some("PrometheusRule"),
        "{RULE_FILE} holds no PrometheusRule"
    );
    let spec = rule["spec"].clone();
    ensure!(
        spec["groups"].as_sequence().is_some_and(|g| !g.is_empty()),
        "{RULE_FILE} has no rule groups"
    );
    Ok(spec)
}

/// Every rule of the rule groups.
fn rules(groups: &Yaml) -> impl Iterator<Item = &Yaml> {
    groups["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_sequence().into_iter().flatten())
}

/// The alerts' names.
fn alert_names(groups: &Yaml) -> BTreeSet<String> {
    rules(groups)
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect()
}

/// A Prometheus duration such as `5m`, `1h30m` or `1500ms`.
fn duration(text: &str) -> anyhow::Result<Duration> {
    let mut total_ms: u64 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(digits);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let number: u64 = number
            .parse()
            .with_context(|| format!("bad duration {text:?}"))?;
        let unit_ms = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            "w" => 604_800_000,
            "y" => 31_536_000_000,
            _ => bail!("bad unit {unit:?} in duration {text:?}"),
        };
        total_ms += number * unit_ms;
        rest = after;
    }
    Ok(Duration::from_millis(total_ms))
}

/// `for_` (a Prometheus duration) divided by 60, in milliseconds, as Prometheus writes them.
fn sixtieth(for_: &str) -> anyhow::Result<String> {
    Ok(format!("{}ms", duration(for_)?.as_millis() / 60))
}

/// The rule groups as the end-to-end test loads them: every `for:` divided by 60 (minutes become
/// seconds), so an alert meant to wait 5 minutes in production waits 5 seconds. Nothing else
/// changes: the expressions are the shipped ones.
fn rule_groups_with_short_for() -> anyhow::Result<Yaml> {
    let mut groups = rule_groups()?;
    for group in groups["groups"].as_sequence_mut().into_iter().flatten() {
        for rule in group["rules"].as_sequence_mut().into_iter().flatten() {
            if let Some(duration) = rule.get("for").and_then(Yaml::as_str) {
                let short = sixtieth(duration)?;
                rule["for"] = Yaml::String(short);
            }
        }
    }
    Ok(groups)
}

#[test]
fn for_durations_are_divided_by_sixty() -> anyhow::Result<()> {
    assert_eq!(sixtieth("5m")?, "5000ms");
    assert_eq!(sixtieth("1h30m")?, "90000ms");
    assert_eq!(sixtieth("90s")?, "1500ms");
    assert_eq!(duration("1500ms")?, Duration::from_millis(1500));
    assert!(sixtieth("5 minutes").is_err());
    Ok(())
}

/// The shipped alerts pass `promtool check rules`; `promtool test rules` runs the unit tests
/// against them; each alert has a test case where it fires and one where it does not; each has
/// a severity, a summary, a description and a runbook, and a row in the alert table of
/// docs/monitoring.md, the alerts' runbook.
#[test]
fn alert_rules_pass_promtool() -> anyhow::Result<()> {
    let groups = rule_groups()?;
    let alerts = alert_names(&groups);
    ensure!(!alerts.is_empty(), "no alerts in {RULE_FILE}");

    let dir = temp_dir("alert-rules")?;
    std::fs::write(dir.join("rules.yaml"), serde_yaml::to_string(&groups)?)?;
    std::fs::copy(
        workspace_root().join(ALERT_TESTS),
        dir.join("alerts_test.yaml"),
    )?;
    let checked = promtool(&dir, &["check", "rules", "rules.yaml"])?;
    let count = rules(&groups).count();
    ensure!(
        checked.contains(&format!("SUCCESS: {count} rules found")),
        "promtool did not check all {count} rules:\n{checked}"
    );
    let tested = promtool(&dir, &["test", "rules", "alerts_test.yaml"])?;
    ensure!(tested.contains("SUCCESS"), "promtool test rules:\n{tested}");

    // Every alert is tested both ways: promtool only checks the alerts a case names.
    let tests: Yaml = serde_yaml::from_str(&std::fs::read_to_string(
        workspace_root().join(ALERT_TESTS),
    )?)?;
    let mut fires = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for case in tests["tests"].as_sequence().into_iter().flatten() {
        for check in case["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = check["alertname"].as_str().unwrap_or_default().to_owned();
            if check["exp_alerts"]
                .as_sequence()
                .is_some_and(|a| !a.is_empty())
            {
                fires.insert(name);
            } else {
                silent.insert(name);
            }
        }
    }
    let untested_firing: Vec<_> = alerts.difference(&fires).collect();
    let untested_silent: Vec<_> = alerts.difference(&silent).collect();
    ensure!(
        untested_firing.is_empty() && untested_silent.is_empty(),
        "{ALERT_TESTS} lacks cases where these fire: {untested_firing:?}, \
         and where these do not: {untested_silent:?}"
    );

    let runbook = std::fs::read_to_string(workspace_root().join("docs/monitoring.md"))?;
    for rule in rules(&groups).filter(|r| r.get("alert").is_some()) {
        let name = rule["alert"].as_str().unwrap_or_default();
        for annotation in ["summary", "description", "runbook"] {
            ensure!(
                rule["annotations"][annotation]
                    .as_str()
                    .is_some_and(|t| !t.trim().is_empty()),
                "{name} has no {annotation} annotation"
            );
        }
        ensure!(
            matches!(
                rule["labels"]["severity"].as_str(),
                Some("warning" | "critical")
            ),
            "{name} has no severity warning or critical"
        );
        ensure!(
            runbook.contains(&format!("| `{name}` |")),
            "the alert table of docs/monitoring.md has no row for {name}"
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Every PromQL expression of the dashboard (`expr` of every target, rows included).
fn dashboard_queries() -> anyhow::Result<Vec<String>> {
    fn collect(value: &Json, out: &mut Vec<String>) {
        match value {
            Json::Object(map) => {
                if let Some(Json::Array(targets)) = map.get("targets") {
                    out.extend(
                        targets
                            .iter()
                            .filter_map(|t| t["expr"].as_str().map(str::to_owned)),
                    );
                }
                map.values().for_each(|v| collect(v, out));
            }
            Json::Array(items) => items.iter().for_each(|v| collect(v, out)),
            _ => {}
        }
    }
    let text = std::fs::read_to_string(workspace_root().join(DASHBOARD_FILE))?;
    let dashboard: Json =
        serde_json::from_str(&text).with_context(|| format!("{DASHBOARD_FILE} is not JSON"))?;
    let mut queries = Vec::new();
    collect(&dashboard["panels"], &mut queries);
    Ok(queries)
}

/// The dashboard's queries are plain PromQL that promtool parses (each becomes a recording rule
/// of a generated rule file), and `config/monitoring` ships the dashboard file unchanged in a
/// ConfigMap labelled for Grafana's sidecar.
#[test]
fn dashboard_queries_parse_and_ship_as_a_configmap() -> anyhow::Result<()> {
    let queries = dashboard_queries()?;
    ensure!(
        queries.len() >= 10,
        "only {} queries in the dashboard",
        queries.len()
    );
    // Grafana variables would make promtool's verdict meaningless; only the data source varies.
    let templated: Vec<_> = queries.iter().filter(|q| q.contains('$')).collect();
    ensure!(
        templated.is_empty(),
        "queries with Grafana variables: {templated:?}"
    );
    let recording: Vec<Yaml> = queries
        .iter()
        .enumerate()
        .map(|(i, expr)| {
            let mut rule = serde_yaml::Mapping::new();
            rule.insert("record".into(), format!("dashboard_query_{i}").into());
            rule.insert("expr".into(), expr.clone().into());
            Yaml::Mapping(rule)
        })
        .collect();
    let mut group = serde_yaml::Mapping::new();
    group.insert("name".into(), "dashboard".into());
    group.insert("rules".into(), Yaml::Sequence(recording));
    let mut file = serde_yaml::Mapping::new();
    file.insert("groups".into(), Yaml::Sequence(vec![Yaml::Mapping(group)]));
    let dir = temp_dir("dashboard-queries")?;
    std::fs::write(
        dir.join("dashboard.yaml"),
        serde_yaml::to_string(&Yaml::Mapping(file))?,
    )?;
    let checked = promtool(&dir, &["check", "rules", "dashboard.yaml"])?;
    ensure!(
        checked.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "promtool did not accept every dashboard query:\n{checked}"
    );
    std::fs::remove_dir_all(&dir)?;

    let shipped = std::fs::read_to_string(workspace_root().join(DASHBOARD_FILE))?;
    let objects = render("config/monitoring")?;
    let config_maps: Vec<_> = objects
        .iter()
        .filter(|o| o["kind"] == "ConfigMap" && o["metadata"]["labels"]["grafana_dashboard"] == "1")
        .collect();
    ensure!(
        config_maps.len() == 1,
        "config/monitoring renders {} dashboard ConfigMaps",
        config_maps.len()
    );
    let data = &config_maps[0]["data"]["controller-sharding-dashboard.json"];
    ensure!(
        data.as_str() == Some(shipped.as_str()),
        "the dashboard ConfigMap does not hold {DASHBOARD_FILE} as it is"
    );
    Ok(())
}

/// A Prometheus server on loopback, with its configuration and data in a directory of its own;
/// killed when dropped.
struct PrometheusServer {
    child: tokio::process::Child,
    base: String,
    dir: PathBuf,
    log: DumpOnFailure,
}

/// What Prometheus scrapes: the secure metrics of one sharder.
struct Target<'a> {
    /// `host:port` of the metrics server.
    address: String,
    /// The bearer token Prometheus sends, as its ServiceAccount token in a cluster.
    token: &'a str,
    /// The CA that signed the serving certificate.
    ca: &'a Path,
}

impl PrometheusServer {
    /// Starts Prometheus with `rules` (a rule file's content), scraping `target` over HTTPS with
    /// its token and evaluating rules every second, and waits until it is ready.
    async fn start(rules: &str, target: &Target<'_>) -> anyhow::Result<Self> {
        let binary = tool("prometheus", "PROMETHEUS")?;
        let dir = temp_dir("prometheus")?;
        std::fs::write(dir.join("rules.yaml"), rules)?;
        let token_file = dir.join("token");
        std::fs::write(&token_file, target.token)?;
        // A second between scrapes and evaluations, so the test sees alerts within seconds. The
        // scrape is what config/monitoring's ServiceMonitor asks the Prometheus Operator for:
        // HTTPS, the token from a file, the server verified against the CA.
        let config = format!(
            r#"global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
- rules.yaml
scrape_configs:
- job_name: sharder
  scheme: https
  authorization:
    credentials_file: {token}
  tls_config:
    ca_file: {ca}
  static_configs:
  - targets: ['{address}']
"#,
            token = token_file.display(),
            ca = target.ca.display(),
            address = target.address,
        );
        std::fs::write(dir.join("prometheus.yml"), config)?;
        let port = free_port()?;
        let log_path = dir.join("prometheus.log");
        let log = std::fs::File::create(&log_path)?;
        let child = tokio::process::Command::new(binary)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("failed to start prometheus")?;
        let server = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
            log: DumpOnFailure::new("prometheus", log_path),
        };
        let ready = format!("{}/-/ready", server.base);
        poll_until("Prometheus ready", Duration::from_secs(30), || {
            let ok = curl(&["-sf", &ready]).is_ok();
            async move { Ok(ok.then_some(())) }
        })
        .await?;
        Ok(server)
    }

    /// `data` of a successful API answer from `path`, with `query` as the query parameter.
    fn api(&self, path: &str, query: Option<&str>) -> anyhow::Result<Json> {
        let url = format!("{}{path}", self.base);
        let parameter = query.map(|q| format!("query={q}"));
        let mut args = vec!["-sS", "-G", url.as_str()];
        if let Some(parameter) = &parameter {
            args.extend(["--data-urlencode", parameter.as_str()]);
        }
        let answer: Json = serde_json::from_str(&curl(&args)?)?;
        ensure!(
            answer["status"] == "success",
            "Prometheus answered {path} ({query:?}) with {answer}"
        );
        Ok(answer["data"].clone())
    }

    /// The result of the instant query `query`.
    fn query(&self, query: &str) -> anyhow::Result<Vec<Json>> {
        let data = self.api("/api/v1/query", Some(query))?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The active (pending or firing) alerts named `alert` whose `label` is `value`.
    fn alerts(&self, alert: &str, label: &str, value: &str) -> anyhow::Result<Vec<Json>> {
        let data = self.api("/api/v1/alerts", None)?;
        Ok(data["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["labels"]["alertname"] == alert && a["labels"][label] == value)
            .cloned()
            .collect())
    }

    /// Stops the server after a passed test and removes its directory.
    async fn passed(mut self) -> anyhow::Result<()> {
        self.log.passed();
        self.child.kill().await?;
        std::fs::remove_dir_all(&self.dir)?;
        Ok(())
    }
}

/// A real Prometheus scraping a sharder's secure metrics as the shipped ServiceMonitor does
/// (HTTPS, the token of a ServiceAccount bound to `sharding:metrics-reader`), with the shipped
/// rules (`for:` divided by 60): when the last shard Lease of a ring goes, "no available shard"
/// turns pending, then fires after its `for:`; when a shard returns, it resolves. Every dashboard
/// query runs on that server too.
///
/// The sharder is one of its own, on a control plane of its own: the shared sharder serves plain
/// metrics to the many tests that read its counters, and a second sharder on the shared cluster
/// would take part in its leader election.
#[tokio::test]
async fn prometheus_fires_and_resolves_no_available_shard() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("monitoring").await?;
    let files = SharderFiles::create(
        dedicated.cluster().kubeconfig(),
        &SharderSettings {
            metrics_secure: true,
            ..SharderSettings::default()
        },
    )?;
    let mut sharder = files.start_process()?;
    files.wait_ready(Duration::from_secs(60)).await?;
    install_metrics_reader(&client).await?;
    let token = service_account_token(&client, &ns, "prometheus").await?;
    bind_metrics_reader(&client, &ns, "prometheus").await?;

    let ring = unique_name("monitoring");
    create_ring(&client, &ring, ring_spec(&ns)).await?;
    for shard in ["shard-a", "shard-b"] {
        create_lease(&client, &ns, &ring, shard, 3600).await?;
    }
    wait_status(&client, &ring, 2, 2).await?;

    let groups = rule_groups_with_short_for()?;
    let for_short = rules(&groups)
        .find(|r| r["alert"] == NO_AVAILABLE_SHARD)
        .and_then(|r| r["for"].as_str())
        .context("the alert has no for:")?
        .to_owned();
    let pending_for = duration(&for_short)?;
    let target = Target {
        address: format!("127.0.0.1:{}", files.metrics_port),
        token: &token,
        ca: &files.ca,
    };
    let prometheus = PrometheusServer::start(&serde_yaml::to_string(&groups)?, &target).await?;

    let available = format!(
        r#"controller_sharding_clusterring_status_available_shards{{clusterring="{ring}"}}"#
    );
    poll_until(
        "Prometheus to scrape the ring with 2 shards",
        Duration::from_secs(30),
        || async {
            let result = prometheus.query(&available)?;
            Ok(result.iter().any(|s| s["value"][1] == "2").then_some(()))
        },
    )
    .await?;
    ensure!(
        prometheus
            .alerts(NO_AVAILABLE_SHARD, "clusterring", &ring)?
            .is_empty(),
        "the alert is active while the ring has 2 shards"
    );
    // With real series behind them, every dashboard query is accepted by the server as well.
    for query in dashboard_queries()? {
        prometheus
            .query(&query)
            .with_context(|| format!("dashboard query {query}"))?;
    }

    // The shards go: both Leases are deleted, as when the shards' Deployment is scaled to 0.
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    for shard in ["shard-a", "shard-b"] {
        leases.delete(shard, &DeleteParams::default()).await?;
    }
    let gone = Instant::now();
    wait_status(&client, &ring, 0, 0).await?;
    let mut pending_seen = None;
    let firing = poll_until("the alert to fire", Duration::from_secs(60), || {
        // Looked at right away (the closure may note when it saw the alert pending); the
        // future only hands the answer over.
        let firing = prometheus
            .alerts(NO_AVAILABLE_SHARD, "clusterring", &ring)
            .map(|alerts| {
                if pending_seen.is_none() && alerts.iter().any(|a| a["state"] == "pending") {
                    pending_seen = Some(gone.elapsed());
                }
                alerts.into_iter().find(|a| a["state"] == "firing")
            });
        async move { firing }
    })
    .await?;
    let fired_after = gone.elapsed();
    // It waited its `for:` as pending before it fired; the test may have seen it pending up to a
    // poll late, so a second is given away.
    let pending_after = pending_seen.context("the alert fired without being pending first")?;
    ensure!(
        fired_after + Duration::from_secs(1) >= pending_after + pending_for,
        "pending at {pending_after:?}, firing at {fired_after:?}: shorter than for: {for_short}"
    );
    assert_eq!(
        firing["annotations"]["summary"],
        format!("ClusterRing {ring} has no available shard.")
    );
    assert_eq!(firing["labels"]["severity"], "critical");
    let series = prometheus.query(&format!(
        r#"ALERTS{{alertname="{NO_AVAILABLE_SHARD}",clusterring="{ring}",alertstate="firing"}}"#
    ))?;
    ensure!(
        series.len() == 1,
        "ALERTS has {} firing series for the ring: {series:?}",
        series.len()
    );

    // One shard returns: the alert resolves (it is no longer listed as active).
    create_lease(&client, &ns, &ring, "shard-a", 3600).await?;
    let returned = Instant::now();
    poll_until("the alert to resolve", Duration::from_secs(30), || async {
        let alerts = prometheus.alerts(NO_AVAILABLE_SHARD, "clusterring", &ring)?;
        Ok(alerts.is_empty().then_some(()))
    })
    .await?;
    let resolved_after = returned.elapsed();
    println!(
        "{NO_AVAILABLE_SHARD} (for: {for_short}): pending {pending_after:?} and firing \
         {fired_after:?} after the last Lease was deleted, resolved {resolved_after:?} after \
         one was created again"
    );

    Api::<ClusterRing>::all(client.clone())
        .delete(&ring, &DeleteParams::default())
        .await?;
    prometheus.passed().await?;
    sharder.passed();
    Ok(())
}
