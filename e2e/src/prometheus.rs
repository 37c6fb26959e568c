//! Reading Prometheus text: the sharder's `/metrics` and the API server's, as the load tools
//! compare them before and after a window.

use kube::Client;

/// Sum of the samples of `name` in the Prometheus text `text` whose labels include every pair of
/// `labels` (exactly, as `key="value"`).
pub fn sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let needles: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| needles.iter().all(|n| l.contains(n.as_str())))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The samples of `name` in `text` with their label text (`client="main",verb="get",...`).
pub fn samples(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix('{')?;
            let (labels, value) = rest.rsplit_once("} ")?;
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Value of label `key` in a sample's label text (`a="x",b="y"`), empty when absent.
pub fn label<'a>(labels: &'a str, key: &str) -> &'a str {
    let needle = format!("{key}=\"");
    labels
        .split(',')
        .find_map(|pair| pair.strip_prefix(needle.as_str()))
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or_default()
}

/// The API server's `/metrics` text.
pub async fn apiserver_metrics(client: &Client) -> anyhow::Result<String> {
    let request = axum::http::Request::get("/metrics").body(Vec::new())?;
    Ok(client.request_text(request).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_select_by_name_and_labels() {
        let text = "\
# HELP x_total doc
x_total{client=\"main\",verb=\"get\"} 2
x_total{client=\"main\",verb=\"list\"} 3
x_total{client=\"leader_election\",verb=\"update\"} 5
x_totalish{client=\"main\"} 100
";
        assert_eq!(sum(text, "x_total", &[]), 10.0);
        assert_eq!(sum(text, "x_total", &[("client", "main")]), 5.0);
        assert_eq!(samples(text, "x_total").len(), 3);
        assert_eq!(label("client=\"main\",verb=\"get\"", "verb"), "get");
        assert_eq!(label("client=\"main\"", "verb"), "");
    }
}
