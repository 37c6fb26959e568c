//! End-to-end tests against a real kube-apiserver (see the `e2e` crate docs for the harness).
//!
//! All tests live in this one binary so the control plane starts once per run.

mod book;
mod cli;
mod controller_manager;
mod crd;
mod external_metrics;
mod faults;
mod leader;
mod load;
mod log_records;
mod manifests;
mod module_graph;
mod monitoring;
mod observability;
mod pins;
mod rebalance;
mod release;
mod ring_kinds;
mod secure_metrics;
mod shard;
mod sharded_watch;
mod sharder;
mod stable;
mod sync_lists;
mod trust;
mod watch_assignment;
mod webhook_server;
mod zero_write;
mod zero_write_cli;
mod zero_write_e2e;
mod zero_write_shard;
