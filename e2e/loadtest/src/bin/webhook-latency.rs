//! `webhook-latency`: what the sharder's webhook adds to the latency of creating objects.
//!
//! Creates Secrets through a real API server in three namespaces, interleaved object by object so
//! that machine noise hits all three alike:
//!
//! - **(a)** a namespace no webhook matches: the API server's own cost;
//! - **(b)** a namespace matched by a trivial mutating webhook served by this tool, which answers
//!   every review with one constant JSON patch: the cost of calling any webhook;
//! - **(c)** a namespace matched by a ring's webhook, served by the real sharder (in-process, as
//!   the end-to-end tests run it) with three available shards: the cost of our webhook.
//!
//! Both webhooks are served the same way — `kube_sharder::server::serve_tls` with a
//! `kube_sharder::server::tls::CertReloader`, an RSA-2048 certificate for 127.0.0.1 from the same generator,
//! on a multi-threaded runtime of their own — so (c)/(b) compares the handlers, not transports.
//! The goal is (c)/(b) ≤ 1.1 at the median.
//!
//! Without `KUBECONFIG` it starts the local control plane of the test harness; with it, it uses
//! that cluster, whose API server must reach webhooks on this host's 127.0.0.1.
//!
//! ```sh
//! cargo run --release -p sharding-e2e --bin webhook-latency -- --count 1000 [--json]
//! ```

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Parser;
use e2e::fixtures::{create_lease, create_ring, ring_spec, wait_status, wait_webhook};
use e2e::latency::Latencies;
use e2e::process::poll_until;
use e2e::renewals::{RenewalCounters, renew};
use e2e::shared_sharder::shared;
use e2e::trivial_webhook::{self, FIXED_LABEL};
use e2e::{Cluster, cluster, unique_name};
use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::{Client, ResourceExt};
use kube_sharding_api::ClusterRing;
use kube_sharding_api::labels;
use serde_json::{Value, json};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Shards of the ring in setup (c).
const SHARDS: [&str; 3] = ["shard-a", "shard-b", "shard-c"];

/// Measures the latency the sharder's webhook adds to creating objects.
#[derive(Debug, Parser)]
#[command(name = "webhook-latency")]
struct Args {
    /// Secrets created per setup and measured.
    #[arg(long, default_value_t = 1000)]
    count: usize,
    /// Secrets created per setup before measuring (connections, caches), not counted.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Give the ring of (c) this many shard Leases (10 s duration), each renewed by the tool every
    /// 2 s for the whole run, instead of three that are never renewed: the webhook's latency
    /// while renewals flow (issue 13 asks for 1,000).
    #[arg(long, default_value_t = 0)]
    renewing_shards: usize,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Renewal period and Lease duration of `--renewing-shards`, as shards run by default.
const RENEW_PERIOD: Duration = Duration::from_secs(2);
const RENEWING_LEASE_SECONDS: i32 = 10;

/// The three setups, in the order of the report.
#[derive(Clone, Copy, Debug)]
enum Setup {
    NoWebhook,
    Trivial,
    Sharder,
}

impl Setup {
    const ALL: [Setup; 3] = [Setup::NoWebhook, Setup::Trivial, Setup::Sharder];

    fn key(self) -> &'static str {
        match self {
            Setup::NoWebhook => "no_webhook",
            Setup::Trivial => "trivial_webhook",
            Setup::Sharder => "sharder_webhook",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Setup::NoWebhook => "(a) no webhook",
            Setup::Trivial => "(b) trivial webhook",
            Setup::Sharder => "(c) sharder webhook",
        }
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ensure!(args.count > 0, "--count must be positive");
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Both block on runtimes of their own; start them before entering ours.
    let cluster = cluster();
    let sharder = shared();
    // The trivial webhook gets a multi-threaded runtime of its own, as the shared sharder has.
    let webhook_runtime = tokio::runtime::Runtime::new().context("failed to start a runtime")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to start a runtime")?;
    let mut logs = sharder.dump_on_failure();
    let report = runtime.block_on(run(&args, cluster, &webhook_runtime))?;
    logs.passed();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.json(&args))?);
    } else {
        print!("{}", report.text(&args));
    }
    Ok(())
}

/// What the run measured.
struct Report {
    stats: Vec<(Setup, Latencies)>,
    /// With `--renewing-shards`: renewals per second and failed renewals while measuring.
    renewals: Option<(f64, u64)>,
}

impl Report {
    fn median(&self, setup: Setup) -> f64 {
        self.stats
            .iter()
            .find(|(s, _)| s.key() == setup.key())
            .map(|(_, stats)| stats.median.as_secs_f64())
            .unwrap_or(f64::NAN)
    }

    fn ratios(&self) -> (f64, f64) {
        let (a, b, c) = (
            self.median(Setup::NoWebhook),
            self.median(Setup::Trivial),
            self.median(Setup::Sharder),
        );
        (b / a, c / b)
    }

    fn text(&self, args: &Args) -> String {
        let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
        let mut out = format!(
            "webhook-latency: {} Secrets per setup, created interleaved, after {} warm-up creates each\n\n",
            args.count, args.warmup
        );
        out.push_str(&format!(
            "{:<22} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
            "setup", "median", "p99", "mean", "min", "max"
        ));
        for (setup, s) in &self.stats {
            out.push_str(&format!(
                "{:<22} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
                setup.title(),
                ms(s.median),
                ms(s.p99),
                ms(s.mean),
                ms(s.min),
                ms(s.max)
            ));
        }
        let (b_a, c_b) = self.ratios();
        if let Some((per_second, failed)) = self.renewals {
            out.push_str(&format!(
                "\nwhile measuring: {} shard Leases of (c)'s ring renewed, {per_second:.1} renewals/s, {failed} failed\n",
                args.renewing_shards
            ));
        }
        out.push_str(&format!("\n(b)/(a) at the median: {b_a:.3}\n"));
        out.push_str(&format!(
            "(c)/(b) at the median: {c_b:.3} (goal ≤ 1.1: {})\n",
            if c_b <= 1.1 { "met" } else { "missed" }
        ));
        out
    }

    fn json(&self, args: &Args) -> Value {
        let (b_a, c_b) = self.ratios();
        let setups: serde_json::Map<String, Value> = self
            .stats
            .iter()
            .map(|(setup, s)| (setup.key().to_string(), s.json()))
            .collect();
        json!({
            "count": args.count,
            "warmup": args.warmup,
            "renewing_shards": args.renewing_shards,
            "renewals_per_second": self.renewals.map(|(r, _)| r),
            "renewal_failures": self.renewals.map(|(_, f)| f),
            "setups": setups,
            "ratios_at_median": {
                "trivial_over_no_webhook": b_a,
                "sharder_over_trivial": c_b,
            },
            "goal_sharder_over_trivial_at_most_1_1": c_b <= 1.1,
        })
    }
}

/// Everything the run created, removed again at the end.
struct Created {
    namespaces: Vec<String>,
    webhook_configurations: Vec<String>,
    ring: Option<String>,
}

async fn run(
    args: &Args,
    cluster: &Cluster,
    webhook_runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<Report> {
    let client = cluster.client().await?;
    let mut created = Created {
        namespaces: Vec::new(),
        webhook_configurations: Vec::new(),
        ring: None,
    };
    let stop = CancellationToken::new();
    let result = measure(args, cluster, &client, webhook_runtime, &stop, &mut created).await;
    stop.cancel();
    clean_up(&client, &created).await;
    result
}

async fn measure(
    args: &Args,
    cluster: &Cluster,
    client: &Client,
    webhook_runtime: &tokio::runtime::Runtime,
    stop: &CancellationToken,
    created: &mut Created,
) -> anyhow::Result<Report> {
    let mut namespaces = Vec::new();
    for prefix in ["latency-none", "latency-trivial", "latency-sharder"] {
        let ns = cluster.namespace(client, prefix).await?;
        created.namespaces.push(ns.clone());
        namespaces.push(ns);
    }

    // (b): the trivial webhook, with a certificate made like the sharder's.
    let cert_dir = std::env::temp_dir().join(unique_name("webhook-latency-certs"));
    // The CA's and the serving certificate's keys go when the run ends, however it ends.
    let _cert_dir = RemoveDirOnDrop(cert_dir.clone());
    let tls = trivial_webhook::loopback_tls(&cert_dir)?;
    let ca_path = cert_dir.join("ca.crt");
    let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .context("failed to listen on loopback")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let app = trivial_webhook::router()?;
    let serving = stop.clone();
    webhook_runtime.spawn(async move {
        // The listener joins the reactor of the runtime that serves it.
        match tokio::net::TcpListener::from_std(listener) {
            Ok(listener) => {
                kube_sharder::server::serve_tls(
                    listener,
                    tls,
                    app,
                    kube_sharder::server::ConnectionLimits::default(),
                    serving,
                    Duration::from_secs(1),
                )
                .await
            }
            Err(error) => eprintln!("trivial webhook failed to listen: {error}"),
        }
    });
    let trivial_name = unique_name("webhook-latency-trivial");
    let ca =
        std::fs::read(&ca_path).with_context(|| format!("failed to read {}", ca_path.display()))?;
    let configuration: MutatingWebhookConfiguration = serde_json::from_value(json!({
        "metadata": {"name": trivial_name},
        "webhooks": [{
            "name": "trivial.latency.sharding.timebertt.dev",
            "clientConfig": {
                "url": format!("https://{addr}{}", trivial_webhook::PATH),
                "caBundle": ByteString(ca),
            },
            "namespaceSelector": {"matchLabels": {e2e::LABEL_NAMESPACE_NAME: namespaces[1]}},
            "rules": [{
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["secrets"],
                "scope": "*",
            }],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "timeoutSeconds": 5,
            "admissionReviewVersions": ["v1"],
        }],
    }))?;
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .create(&PostParams::default(), &configuration)
        .await
        .context("failed to register the trivial webhook")?;
    created.webhook_configurations.push(trivial_name);
    let trivial_secrets = Api::<Secret>::namespaced(client.clone(), &namespaces[1]);
    poll_until(
        "the trivial webhook to label objects",
        Duration::from_secs(30),
        || async {
            let params = PostParams {
                dry_run: true,
                ..Default::default()
            };
            let probe = trivial_secrets.create(&params, &secret("probe")).await?;
            Ok(probe.labels().contains_key(FIXED_LABEL).then_some(()))
        },
    )
    .await?;

    // (c): a ring over the third namespace with three available shards, served by the sharder.
    let ring = unique_name("latency");
    create_ring(client, &ring, ring_spec(&namespaces[2])).await?;
    created.ring = Some(ring.clone());
    created
        .webhook_configurations
        .push(labels::webhook_configuration_name(&ring));
    let renewing: Vec<String> = (0..args.renewing_shards)
        .map(|i| format!("shard-{i:05}"))
        .collect();
    let counters = Arc::new(RenewalCounters::default());
    let shards: Vec<&str> = if renewing.is_empty() {
        for shard in SHARDS {
            create_lease(client, &namespaces[2], &ring, shard, 24 * 3600).await?;
        }
        SHARDS.to_vec()
    } else {
        futures::stream::iter(&renewing)
            .map(|shard| create_lease(client, &namespaces[2], &ring, shard, RENEWING_LEASE_SECONDS))
            .buffer_unordered(50)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<anyhow::Result<Vec<_>>>()?;
        let (api, names, counters, stop) = (
            Api::namespaced(client.clone(), &namespaces[2]),
            renewing.clone(),
            counters.clone(),
            stop.clone(),
        );
        tokio::spawn(async move { renew(api, names, RENEW_PERIOD, 64, &counters, stop).await });
        renewing.iter().map(String::as_str).collect()
    };
    let members = i32::try_from(shards.len())?;
    wait_status(client, &ring, members, members).await?;
    wait_webhook(client, &namespaces[2], &ring, &shards).await?;
    let shard_label = labels::shard_label(&ring);

    let apis: Vec<Api<Secret>> = namespaces
        .iter()
        .map(|ns| Api::namespaced(client.clone(), ns))
        .collect();
    let check = |setup: Setup, object: &Secret| -> anyhow::Result<()> {
        let labels = object.labels();
        let (fixed, shard) = (
            labels.contains_key(FIXED_LABEL),
            labels.contains_key(&shard_label),
        );
        let ok = match setup {
            Setup::NoWebhook => !fixed && !shard,
            Setup::Trivial => fixed && !shard,
            Setup::Sharder => !fixed && shard,
        };
        ensure!(
            ok,
            "{}: {} has unexpected labels {labels:?}",
            setup.title(),
            object.name_any()
        );
        Ok(())
    };

    let mut samples: Vec<Vec<Duration>> = (0..3).map(|_| Vec::with_capacity(args.count)).collect();
    let mut renewals_at_start = (counters.renewals(), counters.failures(), Instant::now());
    for round in 0..args.warmup + args.count {
        let measured = round >= args.warmup;
        let name = if measured {
            format!("secret-{}", round - args.warmup)
        } else {
            format!("warmup-{round}")
        };
        let object = secret(&name);
        // Round-robin with a rotating start, so no setup always goes first.
        for offset in 0..Setup::ALL.len() {
            let index = (round + offset) % Setup::ALL.len();
            let setup = Setup::ALL[index];
            let start = Instant::now();
            let created = apis[index]
                .create(&PostParams::default(), &object)
                .await
                .with_context(|| format!("{}: failed to create {name}", setup.title()))?;
            let elapsed = start.elapsed();
            check(setup, &created)?;
            if round == args.warmup && offset == 0 {
                // Renewals count from the first measured create on.
                renewals_at_start = (counters.renewals(), counters.failures(), start);
            }
            if measured {
                samples[index].push(elapsed);
            }
        }
    }

    let renewals = (!renewing.is_empty()).then(|| {
        let (renewed, failed, since) = renewals_at_start;
        (
            (counters.renewals() - renewed) as f64 / since.elapsed().as_secs_f64(),
            counters.failures() - failed,
        )
    });
    let mut stats = Vec::new();
    for (setup, mut s) in Setup::ALL.into_iter().zip(samples) {
        stats.push((setup, Latencies::of(&mut s)?));
    }
    Ok(Report { stats, renewals })
}

/// A Secret as the run creates it: a label (so both webhooks' patches are one `add`) and a
/// little data.
fn secret(name: &str) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([("app".into(), "webhook-latency".into())])),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "payload".into(),
            ByteString(vec![b'x'; 256]),
        )])),
        ..Default::default()
    }
}

/// Removes what the run created; failures are reported, not fatal. (Without a
/// kube-controller-manager, as on the local control plane, namespaces stay `Terminating` until
/// the control plane stops with the tool.)
async fn clean_up(client: &Client, created: &Created) {
    let params = DeleteParams::default();
    if let Some(ring) = &created.ring
        && let Err(error) = Api::<ClusterRing>::all(client.clone())
            .delete(ring, &params)
            .await
    {
        eprintln!("failed to delete ClusterRing {ring}: {error}");
    }
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    for name in &created.webhook_configurations {
        if let Err(error) = configs.delete(name, &params).await
            && !matches!(&error, kube::Error::Api(s) if s.code == 404)
        {
            eprintln!("failed to delete MutatingWebhookConfiguration {name}: {error}");
        }
    }
    let namespaces = Api::<Namespace>::all(client.clone());
    for name in &created.namespaces {
        if let Err(error) = namespaces.delete(name, &params).await {
            eprintln!("failed to delete namespace {name}: {error}");
        }
    }
}

/// Removes a directory when dropped.
struct RemoveDirOnDrop(std::path::PathBuf);

impl Drop for RemoveDirOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
