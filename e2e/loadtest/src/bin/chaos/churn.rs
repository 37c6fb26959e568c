//! Churn: Secrets created, updated (data changed) and deleted at a steady rate across the ring's
//! namespaces, some of them with an extra ConfigMap they control, created with `generateName`
//! (controlled objects may use it: their hash key is their controller's).
//!
//! Requests fail while the API server restarts; failures are counted, never fatal. The checks
//! read the objects from the API server at the end, so a request that failed on the client side
//! but took effect on the server does not confuse them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PostParams};
use kube::{Client, Resource};
use serde::Serialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::plan::Rng;

/// Prefix of the Secrets' names; each gets a unique number, so no name is ever reused and an
/// object's log records never mix two lives.
pub(crate) const SECRET_PREFIX: &str = "s-";

/// Prefix (before the Secret's name) of the `generateName` of the extra controlled ConfigMaps.
pub(crate) const EXTRA_PREFIX: &str = "extra-";

/// Longest a single request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What the churn did.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct ChurnStats {
    pub(crate) created: u64,
    pub(crate) updated: u64,
    pub(crate) deleted: u64,
    /// Extra ConfigMaps created with `generateName`, controlled by a Secret.
    pub(crate) controlled_config_maps: u64,
    /// Failed requests, by operation.
    pub(crate) failed: BTreeMap<&'static str, u64>,
    /// Operations attempted per second of churn.
    pub(crate) achieved_rate: f64,
}

/// Where and how much to churn.
#[derive(Clone, Debug)]
pub(crate) struct ChurnConfig {
    pub(crate) namespaces: Vec<String>,
    /// Operations per second.
    pub(crate) rate: f64,
    /// Live Secrets to hover around.
    pub(crate) objects: usize,
    pub(crate) seed: u64,
    /// The stream of `seed` to draw from: one per ring, so that rings churn independently.
    pub(crate) stream: u64,
    /// Prefix of the Secrets' names ([`SECRET_PREFIX`] unless a ring needs another).
    pub(crate) prefix: &'static str,
}

/// A Secret the churn created and believes still exists.
#[derive(Debug)]
struct Live {
    namespace: String,
    name: String,
}

/// Churns until `stop` is cancelled; returns what it did.
pub(crate) async fn run(
    client: Client,
    config: ChurnConfig,
    stop: CancellationToken,
) -> ChurnStats {
    let mut rng = crate::plan::Rng::stream(config.seed, config.stream);
    let mut stats = ChurnStats::default();
    let mut live: Vec<Live> = Vec::new();
    let mut next = 0u64;
    let started = Instant::now();
    let mut ops = 0u64;
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / config.rate.max(0.01)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = ticks.tick() => {}
        }
        ops += 1;
        let target = config.objects.max(2);
        let roll = rng.unit();
        let op = if live.len() < target / 2 || (roll < 0.35 && live.len() < target * 3 / 2) {
            Op::Create
        } else if roll < 0.7 {
            Op::Update
        } else {
            Op::Delete
        };
        match op {
            Op::Create => {
                let namespace =
                    config.namespaces[rng.below(config.namespaces.len() as u64) as usize].clone();
                let name = format!("{}{next}", config.prefix);
                next += 1;
                let with_extra = rng.below(4) == 0;
                match create(&client, &namespace, &name, &mut rng, with_extra).await {
                    Ok(extra) => {
                        stats.created += 1;
                        if extra {
                            stats.controlled_config_maps += 1;
                        }
                        live.push(Live { namespace, name });
                    }
                    Err(failed) => *stats.failed.entry(failed).or_default() += 1,
                }
            }
            Op::Update | Op::Delete if live.is_empty() => {}
            Op::Update => {
                let index = rng.below(live.len() as u64) as usize;
                let target = &live[index];
                let secrets = Api::<Secret>::namespaced(client.clone(), &target.namespace);
                let patch = json!({"data": {"value": ByteString(random_bytes(&mut rng))}});
                let sent = tokio::time::timeout(
                    REQUEST_TIMEOUT,
                    secrets.patch(&target.name, &e2e::patch_params(), &Patch::Merge(&patch)),
                )
                .await;
                match sent {
                    Ok(Ok(_)) => stats.updated += 1,
                    Ok(Err(kube::Error::Api(status))) if status.code == 404 => {
                        live.swap_remove(index);
                    }
                    _ => *stats.failed.entry("update").or_default() += 1,
                }
            }
            Op::Delete => {
                let index = rng.below(live.len() as u64) as usize;
                let target = live.swap_remove(index);
                let secrets = Api::<Secret>::namespaced(client.clone(), &target.namespace);
                let sent = tokio::time::timeout(
                    REQUEST_TIMEOUT,
                    secrets.delete(&target.name, &DeleteParams::default()),
                )
                .await;
                match sent {
                    Ok(Ok(_)) => stats.deleted += 1,
                    Ok(Err(kube::Error::Api(status))) if status.code == 404 => {}
                    _ => {
                        *stats.failed.entry("delete").or_default() += 1;
                        live.push(target);
                    }
                }
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if seconds > 0.0 {
        stats.achieved_rate = (ops as f64 / seconds * 100.0).round() / 100.0;
    }
    stats
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Create,
    Update,
    Delete,
}

/// Creates Secret `name`, and with `with_extra` a ConfigMap it controls; returns whether the
/// ConfigMap was created, or which request failed.
async fn create(
    client: &Client,
    namespace: &str,
    name: &str,
    rng: &mut Rng,
    with_extra: bool,
) -> Result<bool, &'static str> {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([
            ("value".to_string(), ByteString(random_bytes(rng))),
            ("name".to_string(), ByteString(name.as_bytes().to_vec())),
        ])),
        ..Default::default()
    };
    let secrets = Api::<Secret>::namespaced(client.clone(), namespace);
    let created = tokio::time::timeout(
        REQUEST_TIMEOUT,
        secrets.create(&PostParams::default(), &secret),
    )
    .await;
    let created = match created {
        Ok(Ok(created)) => created,
        _ => return Err("create"),
    };
    if !with_extra {
        return Ok(false);
    }
    let Some(owner) = created.controller_owner_ref(&()) else {
        return Err("create-controlled");
    };
    let config_map = ConfigMap {
        metadata: ObjectMeta {
            generate_name: Some(format!("{EXTRA_PREFIX}{name}-")),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("secret".to_string(), name.to_string())])),
        ..Default::default()
    };
    let config_maps = Api::<ConfigMap>::namespaced(client.clone(), namespace);
    match tokio::time::timeout(
        REQUEST_TIMEOUT,
        config_maps.create(&PostParams::default(), &config_map),
    )
    .await
    {
        Ok(Ok(_)) => Ok(true),
        _ => Err("create-controlled"),
    }
}

/// Sixteen random bytes: every update changes the checksum.
fn random_bytes(rng: &mut Rng) -> Vec<u8> {
    let (a, b) = (rng.next_u64(), rng.next_u64());
    [a.to_le_bytes(), b.to_le_bytes()].concat()
}
