//! Whether the sharder reads a namespaced resource of a ring namespace by namespace or across the
//! cluster: the sync's lists and the missed-assignment watch follow the same rule.

/// Page size of the sync's lists and of the kubectl plugin's.
pub const PAGE_SIZE: u32 = 500;

/// Most namespaces a ring may select for a sync to list, and the missed-assignment path to watch,
/// its namespaced resources one namespace at a time.
pub(crate) const MAX_NAMESPACE_LISTS: usize = 50;

/// How a sync lists, or the missed-assignment path watches, one namespaced resource of a ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ListScope {
    /// One list (or watch) across the cluster; objects of unselected namespaces are skipped.
    Cluster,
    /// One list (or watch) per selected namespace.
    Namespaces,
}

/// How a sync lists a namespaced resource of a ring that selects `selected` of the cluster's
/// `all` namespaces.
///
/// A list across the cluster reads every object of the resource, in every namespace, and the
/// sharder throws away those of namespaces its ring does not select: a ring over one namespace
/// with 120 ConfigMaps read all 15,721 ConfigMaps of a cluster on every sync. A list per selected
/// namespace reads only what the ring owns, but costs at least one request per namespace, an
/// empty one too, one after the other. So a sync lists namespace by namespace only when the ring
/// selects
/// - at most [`MAX_NAMESPACE_LISTS`] namespaces: beyond that the requests themselves (each
///   passing authentication, admission of the request and priority and fairness) cost more
///   than the objects they spare, whatever the objects' count; and
/// - at most half of all namespaces: otherwise the cluster-wide list reads less than about
///   twice what the ring owns (for namespaces of similar size) in fewer requests.
///
/// The namespaces counted are those of the sharder's namespace cache, the same the sync's
/// filter uses, so both ways assign the same objects: a namespace the cache has not seen yet is
/// skipped either way until the next sync.
///
/// The missed-assignment watch uses the same rule, one watch per selected namespace or one across
/// the cluster, and measurement (`scale-load unselected`, docs/scale.md) supports it there too:
/// - a watch across the cluster costs the sharder about 0.065 ms of CPU for every object created
///   without the shard label in a namespace the ring does not select (it decodes the event and
///   throws it away), once per ring sharding the resource, without end;
/// - a watch per namespace costs 1 to 1.5 ms of CPU when it starts (kube's client speaks
///   HTTP/1.1, so each watch opens a TLS connection of its own before its LIST and WATCH) and
///   about 40 KiB of memory, while idle watches cost nothing measurable: 50 of them took 0.05 to
///   0.07 s more CPU to start than one, the price of 800 to 1,100 unselected CREATEs, paid again
///   at each leadership change and after each API server restart;
/// - so per-namespace watches pay off quickly in a busy cluster, and the cap of
///   [`MAX_NAMESPACE_LISTS`] keeps what their start asks of the sharder and of the API server
///   (connections held, requests at once) near what one sync of the ring already sends; with
///   more than half of all namespaces selected, the watch across the cluster sees at most about
///   twice the events the ring owns (for namespaces of similar activity) over one connection.
pub(crate) fn list_scope(selected: usize, all: usize) -> ListScope {
    if selected <= MAX_NAMESPACE_LISTS && selected.saturating_mul(2) <= all {
        ListScope::Namespaces
    } else {
        ListScope::Cluster
    }
}

/// [`list_scope`] for a watch that runs with the scope `current` already: a watch across the
/// cluster goes back to one per namespace only once the ring selects at most
/// [`NAMESPACE_WATCHES_AGAIN`] namespaces and at most two fifths of them, not at the first
/// namespace below the cut-off. A ring whose selected namespaces hover at the cut-off (namespaces
/// labelled and unlabelled, created and deleted) would otherwise stop and start up to
/// [`MAX_NAMESPACE_LISTS`] watches, each with its connection and first list, at every crossing;
/// between the two bounds either scope costs about the same.
pub(crate) fn watch_scope(current: Option<ListScope>, selected: usize, all: usize) -> ListScope {
    let plain = list_scope(selected, all);
    if current == Some(ListScope::Cluster)
        && plain == ListScope::Namespaces
        && (selected > NAMESPACE_WATCHES_AGAIN
            || selected.saturating_mul(5) > all.saturating_mul(2))
    {
        return ListScope::Cluster;
    }
    plain
}

/// Most selected namespaces at which a missed-assignment watch across the cluster is replaced by
/// one per namespace again ([`watch_scope`]): four fifths of [`MAX_NAMESPACE_LISTS`].
pub(crate) const NAMESPACE_WATCHES_AGAIN: usize = MAX_NAMESPACE_LISTS * 4 / 5;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_across_the_cluster_goes_back_to_namespaces_only_well_below_the_cut_off() {
        let cluster = Some(ListScope::Cluster);
        // Up to the cut-off from below: per namespace, as a list would.
        assert_eq!(watch_scope(None, 50, 10_000), ListScope::Namespaces);
        assert_eq!(
            watch_scope(Some(ListScope::Namespaces), 50, 10_000),
            ListScope::Namespaces
        );
        assert_eq!(watch_scope(None, 51, 10_000), ListScope::Cluster);
        // Back below the cut-off: across the cluster until 40, and two fifths of all.
        assert_eq!(watch_scope(cluster, 50, 10_000), ListScope::Cluster);
        assert_eq!(watch_scope(cluster, 41, 10_000), ListScope::Cluster);
        assert_eq!(watch_scope(cluster, 40, 10_000), ListScope::Namespaces);
        assert_eq!(watch_scope(cluster, 3, 7), ListScope::Cluster);
        assert_eq!(watch_scope(cluster, 2, 7), ListScope::Namespaces);
        assert_eq!(watch_scope(cluster, 2, 5), ListScope::Namespaces);
        // Past the cut-off it is the cluster either way.
        assert_eq!(
            watch_scope(Some(ListScope::Namespaces), 4, 7),
            ListScope::Cluster
        );
    }

    #[test]
    fn few_selected_namespaces_are_listed_one_by_one() {
        assert_eq!(list_scope(1, 7), ListScope::Namespaces);
        assert_eq!(list_scope(1, 2), ListScope::Namespaces);
        assert_eq!(list_scope(50, 10_000), ListScope::Namespaces);
        // Nothing selected: nothing to list.
        assert_eq!(list_scope(0, 0), ListScope::Namespaces);
    }

    #[test]
    fn many_or_most_namespaces_are_listed_across_the_cluster() {
        assert_eq!(list_scope(51, 10_000), ListScope::Cluster);
        assert_eq!(list_scope(5, 7), ListScope::Cluster);
        assert_eq!(list_scope(4, 7), ListScope::Cluster);
        assert_eq!(list_scope(3, 7), ListScope::Namespaces);
        assert_eq!(list_scope(1, 1), ListScope::Cluster);
        assert_eq!(list_scope(usize::MAX, usize::MAX), ListScope::Cluster);
    }
}
