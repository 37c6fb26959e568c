//! `kubectl sharding`: a kubectl plugin that answers what the sharder does and why, computed with
//! the sharder's own ring views, hash keys, membership and rebalance rules, so its answers are
//! exactly the sharder's. It only reads from the cluster.
//!
//! | module | what |
//! |---|---|
//! | `cluster` | reading the cluster: the client from kubectl's flags, rings, Leases, namespaces, objects in pages; API errors named by the permission they lack |
//! | `resources` | API discovery and kubectl-style resource names (plural, singular, kind, short name, `resource.group`) |
//! | `status` | `status [RING]`: rings, shards and where the objects are |
//! | `explain` | `explain RESOURCE NAME`: one object in every ring covering it, and why it is where it is |
//! | `simulate` | `simulate RING`: what adding or removing shards would move |
//! | `ranges` | rings with `assignment: ServerSide`: published and target hash ranges, holders, handover state |
//! | `output` | tables, ages, JSON and YAML |
//! | `fixtures` | (tests only) rings, Leases and objects the tests of the plugin build on |
//!
//! The binary `kubectl-sharding` parses [`Cli`] and calls [`run`].

mod cluster;
mod explain;
#[cfg(test)]
mod fixtures;
mod output;
mod ranges;
mod resources;
mod simulate;
mod status;

use std::io::Write;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kube_sharding_api::RingKind;

pub use self::simulate::ShardChange;

/// Flags of `kubectl sharding`.
#[derive(Debug, Parser)]
#[command(
    name = "kubectl-sharding",
    bin_name = "kubectl sharding",
    version,
    about = "Inspect controller-sharding rings: where objects are, why, and what a membership change would move. Read-only."
)]
pub struct Cli {
    /// How to reach the cluster.
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// Output format.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// kubectl's connection flags.
#[derive(Clone, Debug, Default, Args)]
pub struct ConnectionArgs {
    /// Path of the kubeconfig file; without it `KUBECONFIG`, then `~/.kube/config`, then the
    /// in-cluster service account.
    #[arg(long, global = true, value_name = "PATH")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// The kubeconfig context to use; without it the current context.
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// The kubeconfig cluster to use; without it the context's.
    #[arg(long, global = true, value_name = "NAME")]
    pub cluster: Option<String>,
    /// The kubeconfig user to use; without it the context's.
    #[arg(long, global = true, value_name = "NAME")]
    pub user: Option<String>,
    /// User to impersonate.
    #[arg(long = "as", global = true, value_name = "USER")]
    pub impersonate: Option<String>,
    /// Group to impersonate; may be repeated.
    #[arg(long = "as-group", global = true, value_name = "GROUP")]
    pub impersonate_groups: Vec<String>,
    /// Namespace: of the object for `explain` (default: the context's namespace); for `status`
    /// and `simulate`, count only objects in this namespace.
    #[arg(short = 'n', long, global = true, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// For `status` and `simulate`: count objects in every namespace the ring selects (the
    /// default).
    #[arg(
        short = 'A',
        long,
        global = true,
        conflicts_with = "namespace",
        default_value_t = false
    )]
    pub all_namespaces: bool,
}

/// Output formats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned tables and sentences, for people.
    #[default]
    Table,
    /// JSON, for scripts.
    Json,
    /// YAML, for scripts.
    Yaml,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Rings with their shards, objects per shard and resource, draining and unassigned objects,
    /// and the imbalance (max/mean objects per available shard).
    Status {
        /// Only this ring (of either kind unless --kind is given), as `NAME` or as kubectl names
        /// it, `clusterring/NAME` or `controllerring/NAME` (plural or `.sharding.timebertt.dev`
        /// also taken).
        #[arg(value_name = "[KIND/]RING")]
        ring: Option<String>,
        /// Only rings of this kind, `ClusterRing` or `ControllerRing` (default: both).
        #[arg(long)]
        kind: Option<RingKind>,
    },
    /// One object in every ring covering it: its hash key, the shard the ring wants, its labels,
    /// and why it is (not) there.
    Explain {
        /// The object as kubectl takes it: `TYPE NAME` or `TYPE/NAME`, where `TYPE` is the
        /// plural, singular, kind or short name, optionally `TYPE.GROUP` or
        /// `TYPE.VERSION.GROUP` (`secret demo`, `secret/demo`, `deploy.apps/web`).
        #[arg(value_name = "TYPE[.GROUP][/NAME]")]
        resource: String,
        /// The object's name, when the first argument is only the type.
        #[arg(value_name = "NAME")]
        name: Option<String>,
    },
    /// How many objects would move from and to each shard if shards were added or removed, and
    /// the resulting distribution. Writes nothing.
    Simulate {
        /// The ring, as `NAME`, `clusterring/NAME` or `controllerring/NAME`.
        #[arg(value_name = "[KIND/]RING")]
        ring: String,
        /// The ring's kind, `ClusterRing` or `ControllerRing`; needed when both kinds have a
        /// ring of this name.
        #[arg(long)]
        kind: Option<RingKind>,
        /// A shard that joins, as `NAME` or `NAME:WEIGHT` (weight 1 to 10, default 1); naming
        /// an available shard changes its weight. May be repeated.
        #[arg(long = "add-shard", value_name = "NAME[:WEIGHT]")]
        add: Vec<ShardChange>,
        /// An available shard that leaves. May be repeated.
        #[arg(long = "remove-shard", value_name = "NAME")]
        remove: Vec<String>,
    },
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kubeconfig could not be loaded or used.
    #[error("failed to load the kubeconfig: {0}")]
    Kubeconfig(String),
    /// A ring of that name does not exist.
    #[error("{0}")]
    RingNotFound(String),
    /// The resource is not served by the API server.
    #[error("the server doesn't have a resource type {0:?}")]
    UnknownResource(String),
    /// The object does not exist.
    #[error("{resource} {name:?} not found{}", in_namespace(.namespace.as_deref()))]
    ObjectNotFound {
        /// The resource, e.g. `secrets` or `deployments.apps`.
        resource: String,
        /// The object's name.
        name: String,
        /// The namespace looked in, for namespaced resources.
        namespace: Option<String>,
    },
    /// The caller lacks a permission.
    #[error(
        "forbidden: kubectl sharding needs permission to {action}, which you do not have: {message}"
    )]
    Forbidden {
        /// What was refused, e.g. `list leases.coordination.k8s.io in all namespaces`.
        action: String,
        /// The API server's message.
        message: String,
    },
    /// Another API error.
    #[error("failed to {action}: {source}")]
    Api {
        /// What failed, e.g. `list secrets in all namespaces`.
        action: String,
        /// Underlying error.
        #[source]
        source: kube::Error,
    },
    /// The flags ask for something that cannot be done.
    #[error("{0}")]
    Usage(String),
    /// Writing the output failed.
    #[error("failed to write the output: {0}")]
    Output(String),
}

/// The error for a ring `name` that does not exist as `kind` (or as either kind).
fn ring_not_found(name: &str, kind: Option<RingKind>) -> Error {
    Error::RingNotFound(match kind {
        Some(kind) => format!("{kind} {name:?} not found"),
        None => format!("no ClusterRing or ControllerRing named {name:?}"),
    })
}

/// The resource and name of an object given as kubectl takes it: `TYPE/NAME` in one argument,
/// or `TYPE` and `NAME` in two.
fn object_arg<'a>(first: &'a str, second: Option<&'a str>) -> Result<(&'a str, &'a str), Error> {
    let usage = |message: &str| Err(Error::Usage(message.into()));
    match (first.split_once('/'), second) {
        (Some(_), Some(_)) => usage(
            "there is no need to give the type as a separate argument when the object is given as TYPE/NAME",
        ),
        (Some((resource, name)), None) if !resource.is_empty() && !name.is_empty() => {
            if name.contains('/') {
                return usage("an object's name cannot contain '/': give TYPE/NAME or TYPE NAME");
            }
            Ok((resource, name))
        }
        (Some(_), None) => usage("give the object as TYPE/NAME or TYPE NAME, both non-empty"),
        (None, None) => usage(
            "give the object's name too, as TYPE NAME or TYPE/NAME (e.g. `secret demo` or `secret/demo`)",
        ),
        (None, Some(name)) if name.is_empty() || name.contains('/') => {
            usage("an object's name is non-empty and cannot contain '/'")
        }
        (None, Some(name)) => Ok((first, name)),
    }
}

/// The name and kind of a ring given as `NAME` or `KIND/NAME`, where `KIND` is how kubectl names
/// the ring resources (`clusterring`, `clusterrings`, `clusterrings.sharding.timebertt.dev`, in
/// any case, and the same for `controllerring`). A kind given both ways must agree.
fn ring_arg(arg: &str, kind: Option<RingKind>) -> Result<(&str, Option<RingKind>), Error> {
    let Some((resource, name)) = arg.split_once('/') else {
        return Ok((arg, kind));
    };
    let resource = resource.to_ascii_lowercase();
    let bare = resource
        .strip_suffix(".sharding.timebertt.dev")
        .unwrap_or(&resource);
    let named = match bare {
        "clusterring" | "clusterrings" => RingKind::ClusterRing,
        "controllerring" | "controllerrings" => RingKind::ControllerRing,
        _ => {
            return Err(Error::Usage(format!(
                "{arg:?} names no ring: give NAME, clusterring/NAME or controllerring/NAME"
            )));
        }
    };
    if name.is_empty() || name.contains('/') {
        return Err(Error::Usage(format!(
            "{arg:?}: a ring's name is non-empty and cannot contain '/'"
        )));
    }
    if kind.is_some_and(|kind| kind != named) {
        return Err(Error::Usage(format!(
            "{arg:?} names a {named}, but --kind says otherwise"
        )));
    }
    Ok((name, Some(named)))
}

fn in_namespace(namespace: Option<&str>) -> String {
    namespace.map_or_else(String::new, |ns| format!(" in namespace {ns:?}"))
}

/// Runs one command and writes its answer to `out`.
pub async fn run(cli: Cli, out: &mut dyn Write) -> Result<(), Error> {
    let connection = cluster::connect(&cli.connection).await?;
    let scope = cli.connection.namespace.as_deref();
    let rendered = match cli.command {
        Command::Status { ring, kind } => {
            let (ring, kind) = match ring.as_deref() {
                Some(ring) => {
                    let (name, kind) = ring_arg(ring, kind)?;
                    (Some(name), kind)
                }
                None => (None, kind),
            };
            let report = status::run(&connection, ring, kind, scope).await?;
            output::render(cli.output, &report, status::table)?
        }
        Command::Explain { resource, name } => {
            if cli.connection.all_namespaces {
                return Err(Error::Usage(
                    "explain looks at one object: use -n NAMESPACE, not -A".into(),
                ));
            }
            let (resource, name) = object_arg(&resource, name.as_deref())?;
            let namespace = scope.unwrap_or(&connection.default_namespace);
            let report = explain::run(&connection, resource, name, namespace).await?;
            output::render(cli.output, &report, explain::table)?
        }
        Command::Simulate {
            ring,
            kind,
            add,
            remove,
        } => {
            let (ring, kind) = ring_arg(&ring, kind)?;
            let report = simulate::run(&connection, ring, kind, &add, &remove, scope).await?;
            output::render(cli.output, &report, simulate::report_table)?
        }
    };
    out.write_all(rendered.as_bytes())
        .map_err(|e| Error::Output(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(args: &[&str]) -> Result<(String, String), String> {
        let cli = Cli::try_parse_from(["kubectl-sharding", "explain"].iter().chain(args))
            .map_err(|e| e.kind().to_string())?;
        let Command::Explain { resource, name } = cli.command else {
            unreachable!("explain parses as explain")
        };
        object_arg(&resource, name.as_deref())
            .map(|(r, n)| (r.to_string(), n.to_string()))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn explain_takes_an_object_in_every_form_kubectl_does() {
        let ok = |r: &str, n: &str| Ok((r.to_string(), n.to_string()));
        assert_eq!(object(&["secret", "demo"]), ok("secret", "demo"));
        assert_eq!(object(&["secret/demo"]), ok("secret", "demo"));
        assert_eq!(object(&["Secret/demo"]), ok("Secret", "demo"));
        assert_eq!(object(&["cm/demo"]), ok("cm", "demo"));
        assert_eq!(object(&["deploy.apps/web"]), ok("deploy.apps", "web"));
        assert_eq!(
            object(&["deployments.v1.apps", "web"]),
            ok("deployments.v1.apps", "web")
        );
        assert!(object(&["secret/demo", "other"]).is_err_and(|e| e.contains("no need")));
        assert!(object(&["secret"]).is_err_and(|e| e.contains("TYPE NAME")));
        assert!(object(&["secret/"]).is_err());
        assert!(object(&["/demo"]).is_err());
        assert!(object(&["secret/a/b"]).is_err_and(|e| e.contains("'/'")));
        assert!(object(&["secret", "a/b"]).is_err_and(|e| e.contains("'/'")));
        assert!(object(&[]).is_err());
    }

    #[test]
    fn rings_are_named_as_kubectl_names_them() {
        use RingKind::{ClusterRing, ControllerRing};
        assert_eq!(ring_arg("example", None).ok(), Some(("example", None)));
        assert_eq!(
            ring_arg("example", Some(ControllerRing)).ok(),
            Some(("example", Some(ControllerRing)))
        );
        for arg in [
            "clusterring/example",
            "ClusterRings/example",
            "clusterrings.sharding.timebertt.dev/example",
        ] {
            assert_eq!(
                ring_arg(arg, None).ok(),
                Some(("example", Some(ClusterRing))),
                "{arg}"
            );
        }
        assert_eq!(
            ring_arg("controllerring/example", Some(ControllerRing)).ok(),
            Some(("example", Some(ControllerRing)))
        );
        assert!(ring_arg("controllerring/example", Some(ClusterRing)).is_err());
        assert!(ring_arg("secret/example", None).is_err());
        assert!(ring_arg("clusterring/", None).is_err());
    }

    #[test]
    fn kubeconfig_selection_flags_parse_anywhere() {
        let cli = Cli::try_parse_from([
            "kubectl-sharding",
            "status",
            "--cluster",
            "c",
            "--user=u",
            "--context",
            "x",
        ])
        .expect("flags parse");
        assert_eq!(cli.connection.cluster.as_deref(), Some("c"));
        assert_eq!(cli.connection.user.as_deref(), Some("u"));
        assert_eq!(cli.connection.context.as_deref(), Some("x"));
    }
}
