//! The secure metrics (`metrics.secure`) against a real API server: a sharder process serves them
//! over HTTPS, and only a ServiceAccount token bound to the shipped `sharding:metrics-reader`
//! reads them; tokens are reviewed once, not on every scrape; the health port stays plain.

use std::time::Duration;

use anyhow::ensure;
use e2e::metrics_access::{
    bind_metrics_reader, install_metrics_reader, service_account_token, token_for,
};
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

/// With `metrics.tokenAudiences` set, only a token issued for that audience reads the metrics:
/// the reader's ordinary token (the API server's audience) is refused. And a flood of random
/// tokens, kept up past the time the scraper's cached answer expires (so its token is reviewed
/// again in the middle of the flood), never keeps the scraper out: every scrape gets 200.
#[tokio::test]
async fn secure_metrics_honour_audiences_and_outlast_a_flood_of_random_tokens() -> anyhow::Result<()>
{
    const AUDIENCE: &str = "controller-sharding-metrics";
    const FLOODERS: usize = 12;
    let DedicatedScenario {
        dedicated,
        client,
        ns,
    } = DedicatedScenario::in_namespace("metrics-flood").await?;
    let files = SharderFiles::create(
        dedicated.cluster().kubeconfig(),
        &SharderSettings {
            metrics_secure: true,
            metrics_token_audiences: vec![AUDIENCE.into()],
            ..SharderSettings::default()
        },
    )?;
    let mut sharder = files.start_process()?;
    files.wait_ready(Duration::from_secs(60)).await?;
    install_metrics_reader(&client).await?;
    let ordinary = service_account_token(&client, &ns, "reader").await?;
    bind_metrics_reader(&client, &ns, "reader").await?;
    let scraper = token_for(&client, &ns, "reader", vec![AUDIENCE.into()]).await?;

    let (status, _) = files.scrape_metrics(Some(&ordinary))?;
    assert_eq!(
        status, 401,
        "a token for the API server's audience was accepted"
    );
    let (status, text) = files.scrape_metrics(Some(&scraper))?;
    assert_eq!(status, 200, "{text}");
    // When the scraper's answers expire: the sharder's own cache time, from now.
    let expired_at = std::time::Instant::now() + Duration::from_secs(125);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let url = files.metrics_url();
    let ca = files.ca.display().to_string();
    let flooders: Vec<_> = (0..FLOODERS)
        .map(|f| {
            let (stop, url, ca) = (stop.clone(), url.clone(), ca.clone());
            std::thread::spawn(move || {
                let mut sent = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let header = format!("Authorization: Bearer random-{f}-{sent}");
                    let _ = std::process::Command::new("curl")
                        .args(["-s", "-o", "/dev/null", "--max-time", "15", "--cacert", &ca])
                        .args(["-H", &header, &url])
                        .status();
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    let mut scrapes = 0;
    let mut refused = Vec::new();
    while std::time::Instant::now() < expired_at + Duration::from_secs(15) {
        let (status, _) = files.scrape_metrics(Some(&scraper))?;
        scrapes += 1;
        if status != 200 {
            refused.push(status);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent: u64 = flooders
        .into_iter()
        .map(|f| f.join().unwrap_or_default())
        .sum();
    let text = files.scrape_metrics(Some(&scraper))?.1;
    println!(
        "{sent} random tokens sent, {} TokenReviews; the scraper got {scrapes} scrapes, refused: {refused:?}",
        reviews(&text, "tokenreviews")
    );
    ensure!(
        refused.is_empty(),
        "the scraper was refused during the flood: {refused:?}"
    );
    // Its token was reviewed again during the flood (the first review, and one after expiry).
    ensure!(sent > 0, "the flood sent nothing");
    sharder.passed();
    Ok(())
}
