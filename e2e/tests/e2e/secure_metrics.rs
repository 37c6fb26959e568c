//! The secure metrics (`metrics.secure`) against a real API server: a sharder process serves them
//! over HTTPS, and only a ServiceAccount token bound to the shipped `sharding:metrics-reader`
//! reads them; tokens are reviewed once, not on every scrape; the health port stays plain.

use std::time::Duration;

use anyhow::ensure;
use e2e::metrics_access::{bind_metrics_reader, install_metrics_reader, service_account_token};
use e2e::net::curl;
use e2e::prometheus::sum;
use e2e::scenario::DedicatedScenario;
use e2e::sharder_process::{SharderFiles, SharderSettings};

const API_REQUESTS: &str = "controller_sharding_api_requests_total";

/// Reviews of `resource` (`tokenreviews`, `subjectaccessreviews`) the sharder sent, from its
/// own request counter in the metrics text `text`.
fn reviews(text: &str, resource: &str) -> f64 {
    sum(
        text,
        API_REQUESTS,
        &[("verb", "create"), ("resource", resource)],
    )
}

#[tokio::test]
async fn secure_metrics_admit_only_tokens_allowed_to_get_them() -> anyhow::Result<()> {
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("secure-metrics").await?;
    let files = SharderFiles::create(
        dedicated.cluster().kubeconfig(),
        &SharderSettings {
            metrics_secure: true,
            ..SharderSettings::default()
        },
    )?;
    let mut sharder = files.start_process()?;
    files.wait_ready(Duration::from_secs(60)).await?;

    // A reader bound to the shipped ClusterRole, and a stranger bound to nothing.
    install_metrics_reader(&client).await?;
    let reader = service_account_token(&client, &ns, "reader").await?;
    bind_metrics_reader(&client, &ns, "reader").await?;
    let stranger = service_account_token(&client, &ns, "stranger").await?;
    // The reader's token with its signature changed: well-formed, but not the API server's. The
    // signature's first character is changed: all six of its bits are signature bits, where the
    // last character of the base64url text carries padding bits a decoder ignores (changing only
    // those would leave the signature, and the token, valid).
    let signature = reader.rfind('.').expect("a JWT") + 1;
    let replacement = if reader[signature..].starts_with('A') {
        "B"
    } else {
        "A"
    };
    let forged = format!(
        "{}{replacement}{}",
        &reader[..signature],
        &reader[signature + 1..]
    );

    // No token, or one the API server does not accept: 401, saying nothing more. The same
    // forged token twice costs one review (negative answers are cached as well).
    assert_eq!(files.scrape_metrics(None)?, (401, "unauthorized\n".into()));
    for _ in 0..2 {
        let (status, body) = files.scrape_metrics(Some(&forged))?;
        assert_eq!((status, body.as_str()), (401, "unauthorized\n"));
    }
    // A valid token of a user without the permission: 403, twice, one review of each kind.
    for _ in 0..2 {
        assert_eq!(
            files.scrape_metrics(Some(&stranger))?,
            (403, "forbidden\n".into())
        );
    }
    // The reader gets the metrics.
    let (status, first) = files.scrape_metrics(Some(&reader))?;
    assert_eq!(status, 200, "{first}");
    ensure!(
        first.contains("# TYPE controller_sharding_api_requests counter"),
        "not the sharder's metrics:\n{first}"
    );
    // Rendered after this request's own reviews: one TokenReview per distinct token (forged,
    // stranger, reader), one SubjectAccessReview per authenticated user (stranger, reader).
    assert_eq!(reviews(&first, "tokenreviews"), 3.0, "{first}");
    assert_eq!(reviews(&first, "subjectaccessreviews"), 2.0, "{first}");

    // Scraping again and again with the same token asks the API server nothing more.
    let mut last = String::new();
    for _ in 0..5 {
        let (status, text) = files.scrape_metrics(Some(&reader))?;
        assert_eq!(status, 200, "{text}");
        last = text;
    }
    assert_eq!(reviews(&last, "tokenreviews"), 3.0, "{last}");
    assert_eq!(reviews(&last, "subjectaccessreviews"), 2.0, "{last}");

    // Plain HTTP gets nothing from the metrics port: it speaks TLS only.
    let plain = format!("http://127.0.0.1:{}/metrics", files.metrics_port);
    ensure!(
        curl(&["-sS", "--max-time", "5", &plain]).is_err(),
        "the secure metrics port answered plain HTTP"
    );
    // The health port stays plain and says only ok.
    for path in ["/healthz", "/readyz"] {
        let url = format!("http://127.0.0.1:{}{path}", files.health_port);
        assert_eq!(curl(&["-sf", &url])?, "ok\n");
    }

    sharder.passed();
    Ok(())
}
