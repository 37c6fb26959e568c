//! Who may read the metrics: the bearer token of every request is authenticated by the API server
//! (a TokenReview) and the user it names is authorized for `get` on the non-resource URL
//! `/metrics` (a SubjectAccessReview), as the API server itself and kubelet do for their own
//! metrics. A scraper therefore needs only its ServiceAccount token and a ClusterRole such as the
//! shipped `sharding:metrics-reader`.
//!
//! Both answers are cached for a short while, negative ones too, so a scraper that comes back
//! every 15 or 30 seconds costs the API server two reviews every couple of minutes rather than two
//! per scrape. The caches are bounded in entries and keep a hash of each token, never the token,
//! so a client sending random tokens cannot grow the sharder's memory.
//!
//! Whoever reaches the port can send tokens, so a flood of random ones must not keep a real
//! scraper out: refusals are cached apart from acceptances (they cannot push a scraper's entry
//! out), and reviews run in two lanes, each with its own client, rate limit, turns and timeout.
//! Tokens accepted within the last hour (a scraper whose cached answer expired) and every
//! SubjectAccessReview (only accepted tokens get there) use the known lane; any other token
//! waits briefly for the new-token lane, where random tokens queue, and is answered 503 if it
//! gets no turn. A scraper's rotated token is new too, so during such a flood it may wait a few
//! scrapes to be accepted.
//!
//! With `metrics.tokenAudiences` set, the TokenReview asks for those audiences: a token issued
//! for the API server (which a sharder could replay) is refused.

pub(super) mod cache;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use self::cache::ExpiringCache;

use crate::records;

/// The path every scrape is authorized for, whatever it asks: the server has no other route.
pub(crate) const METRICS_PATH: &str = "/metrics";

/// How long an authenticated token and an allowed user are remembered. Longer than the usual
/// scrape intervals (15 s, 30 s, 1 min), so most scrapes cost no API call; short enough that a
/// deleted ServiceAccount or a removed binding stops scraping within two minutes.
pub(crate) const ALLOWED_TTL: Duration = Duration::from_secs(120);

/// How long a rejected token and a forbidden user are remembered: a misconfigured scraper that
/// retries costs few reviews, and a binding just created takes effect within seconds.
pub(crate) const DENIED_TTL: Duration = Duration::from_secs(10);

/// Entries of each cache. A Prometheus server uses one token per replica it scrapes; a thousand
/// leaves room for many scrapers while bounding the memory to well under a megabyte.
pub(crate) const MAX_ENTRIES: usize = 1000;

/// Refusals remembered: far more than acceptances, as each costs 32 bytes and a flood of random
/// tokens sends many; kept apart, so they never push an accepted token out.
pub(crate) const MAX_REFUSED: usize = 10_000;

/// How long a token the API server accepted counts as known: its later reviews use the known
/// lane. About a projected token's lifetime.
pub(crate) const KNOWN_TTL: Duration = Duration::from_secs(3600);

/// Reviews sent at once per lane. A client sending new tokens as fast as it can thus keeps only a
/// few API calls in flight; the rest wait their turn.
const MAX_REVIEWS_IN_FLIGHT: usize = 4;

/// How long a request waits for its reviews in the known lane (a turn and the API call) before
/// it is refused.
pub(super) const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a new token waits for its review: a flood's requests are answered 503 soon rather
/// than holding connections of the metrics server.
const NEW_TOKEN_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest token looked at. Service account tokens are a kilobyte or two; a longer header is not
/// worth a review.
const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// Body of the 401 answer: nothing about the request, nothing about why.
const UNAUTHORIZED: &str = "unauthorized\n";

/// Body of the 403 answer.
const FORBIDDEN: &str = "forbidden\n";

/// Body of the 503 answer when the API server could not be asked.
const UNAVAILABLE: &str = "authentication unavailable\n";

/// A review the API server did not answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReviewError {
    /// The request failed.
    #[error("failed to create a {kind}")]
    Api {
        /// `TokenReview` or `SubjectAccessReview`.
        kind: &'static str,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// No answer within the lane's timeout.
    #[error("failed to get a review answered in time")]
    Timeout,
}

/// The user a token stands for, as the TokenReview named it: what the SubjectAccessReview asks
/// about, and the key of the authorization cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct User {
    pub(super) name: String,
    pub(super) uid: String,
    pub(super) groups: Vec<String>,
    pub(super) extra: BTreeMap<String, Vec<String>>,
}

impl From<UserInfo> for User {
    fn from(info: UserInfo) -> Self {
        Self {
            name: info.username.unwrap_or_default(),
            uid: info.uid.unwrap_or_default(),
            groups: info.groups.unwrap_or_default(),
            extra: info.extra.unwrap_or_default(),
        }
    }
}

/// What a request may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Authenticated and authorized.
    Allowed,
    /// No token, or one the API server does not accept: 401.
    Unauthenticated,
    /// A valid token whose user may not `get` `/metrics`: 403.
    Forbidden,
}

/// The clients the reviews go through: one per lane (see the module docs).
pub(crate) struct ReviewClients {
    /// Reviews of tokens not accepted before.
    pub(crate) new_tokens: Client,
    /// Reviews of tokens accepted before, and SubjectAccessReviews.
    pub(crate) known: Client,
}

/// One lane of reviews: its client, turns and timeout.
pub(super) struct Lane {
    pub(super) client: Client,
    turns: Semaphore,
    timeout: Duration,
}

impl Lane {
    pub(super) fn new(client: Client, timeout: Duration) -> Self {
        Self {
            client,
            turns: Semaphore::new(MAX_REVIEWS_IN_FLIGHT),
            timeout,
        }
    }
}

/// Reviews of scrapers' tokens through the API server, with their answers cached (not `Debug`:
/// kube's `Client` is not).
pub(crate) struct MetricsAuth {
    new_tokens: Lane,
    known: Lane,
    /// Audiences the TokenReview asks for; empty: the API server's.
    audiences: Vec<String>,
    /// SHA-256 of an accepted token → its user.
    accepted: Mutex<ExpiringCache<[u8; 32], User>>,
    /// SHA-256 of a refused token.
    refused: Mutex<ExpiringCache<[u8; 32], ()>>,
    /// SHA-256 of a token accepted within [`KNOWN_TTL`].
    known_tokens: Mutex<ExpiringCache<[u8; 32], ()>>,
    /// User → whether it may read the metrics.
    access: Mutex<ExpiringCache<User, bool>>,
}

impl MetricsAuth {
    /// Reviews through `clients`, asking for `audiences` (empty: the API server's).
    pub(crate) fn new(clients: ReviewClients, audiences: Vec<String>) -> Self {
        Self {
            new_tokens: Lane::new(clients.new_tokens, NEW_TOKEN_TIMEOUT),
            known: Lane::new(clients.known, REVIEW_TIMEOUT),
            audiences,
            accepted: Mutex::new(ExpiringCache::new(MAX_ENTRIES)),
            refused: Mutex::new(ExpiringCache::new(MAX_REFUSED)),
            known_tokens: Mutex::new(ExpiringCache::new(MAX_ENTRIES)),
            access: Mutex::new(ExpiringCache::new(MAX_ENTRIES)),
        }
    }

    /// What the request with `headers` may do, asking the API server only what the caches do
    /// not know.
    pub(crate) async fn check(&self, headers: &HeaderMap) -> Result<Access, ReviewError> {
        let Some(token) = bearer_token(headers) else {
            return Ok(Access::Unauthenticated);
        };
        let Some(user) = self.authenticate(token).await? else {
            return Ok(Access::Unauthenticated);
        };
        Ok(if self.authorize(&user).await? {
            Access::Allowed
        } else {
            Access::Forbidden
        })
    }

    /// The user `token` stands for, or `None` when the API server does not accept it (for the
    /// configured audiences).
    async fn authenticate(&self, token: &str) -> Result<Option<User>, ReviewError> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let now = now();
        if let Some(user) = lock(&self.accepted).get(&key, now) {
            return Ok(Some(user));
        }
        if lock(&self.refused).get(&key, now).is_some() {
            return Ok(None);
        }
        let lane = if lock(&self.known_tokens).get(&key, now).is_some() {
            &self.known
        } else {
            &self.new_tokens
        };
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                // None: the API server's own audiences.
                audiences: Some(self.audiences.clone()).filter(|a| !a.is_empty()),
            },
            ..TokenReview::default()
        };
        let answer = review_in(
            lane,
            Api::<TokenReview>::all(lane.client.clone()),
            review,
            "TokenReview",
        )
        .await?;
        let user = answer
            .status
            .filter(|s| s.authenticated == Some(true))
            // An audience-aware API server names the requested audiences the token is valid
            // for; with none named it may not have checked them.
            .filter(|s| {
                self.audiences.is_empty()
                    || s.audiences
                        .iter()
                        .flatten()
                        .any(|a| self.audiences.contains(a))
            })
            .and_then(|s| s.user)
            .map(User::from);
        let now = self::now();
        match &user {
            Some(user) => {
                lock(&self.accepted).insert(key, user.clone(), now + ALLOWED_TTL, now);
                lock(&self.known_tokens).insert(key, (), now + KNOWN_TTL, now);
            }
            None => lock(&self.refused).insert(key, (), now + DENIED_TTL, now),
        }
        Ok(user)
    }

    /// Whether `user` may `get` the non-resource URL `/metrics`.
    async fn authorize(&self, user: &User) -> Result<bool, ReviewError> {
        let attributes = Attributes::NonResource(NonResourceAttributes {
            path: Some(METRICS_PATH.into()),
            verb: Some("get".into()),
        });
        access_review(&self.known, &self.access, user.clone(), user, attributes).await
    }
}

/// What a SubjectAccessReview asks about: a non-resource URL or a resource.
pub(super) enum Attributes {
    /// A non-resource URL, such as `/metrics`.
    NonResource(NonResourceAttributes),
    /// A resource, such as an external metric.
    Resource(Box<ResourceAttributes>),
}

/// Whether `user` may do what `attributes` say: remembered in `cache` under `key` (allowed for
/// [`ALLOWED_TTL`], refused for [`DENIED_TTL`]), else asked with a SubjectAccessReview in `lane`.
pub(super) async fn access_review<K: Eq + std::hash::Hash + Clone>(
    lane: &Lane,
    cache: &Mutex<ExpiringCache<K, bool>>,
    key: K,
    user: &User,
    attributes: Attributes,
) -> Result<bool, ReviewError> {
    if let Some(known) = lock(cache).get(&key, now()) {
        return Ok(known);
    }
    let (non_resource_attributes, resource_attributes) = match attributes {
        Attributes::NonResource(a) => (Some(a), None),
        Attributes::Resource(a) => (None, Some(*a)),
    };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            uid: Some(user.uid.clone()).filter(|u| !u.is_empty()),
            groups: Some(user.groups.clone()),
            extra: Some(user.extra.clone()),
            non_resource_attributes,
            resource_attributes,
        },
        ..SubjectAccessReview::default()
    };
    let answer = review_in(
        lane,
        Api::<SubjectAccessReview>::all(lane.client.clone()),
        review,
        "SubjectAccessReview",
    )
    .await?;
    let allowed = answer.status.is_some_and(|s| s.allowed);
    let ttl = if allowed { ALLOWED_TTL } else { DENIED_TTL };
    let now = now();
    lock(cache).insert(key, allowed, now + ttl, now);
    Ok(allowed)
}

/// Creates `review` in `lane` and returns the API server's answer, waiting for a turn first.
pub(super) async fn review_in<K>(
    lane: &Lane,
    api: Api<K>,
    review: K,
    kind: &'static str,
) -> Result<K, ReviewError>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    tokio::time::timeout(lane.timeout, async {
        let _turn = lane.turns.acquire().await;
        api.create(&PostParams::default(), &review)
            .await
            .map_err(|source| ReviewError::Api { kind, source })
    })
    .await
    .map_err(|_| ReviewError::Timeout)?
}

/// The bearer token of the `Authorization` header, as Kubernetes reads it: the scheme `Bearer`
/// in any case, a space, a non-empty token.
fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty() && token.len() <= MAX_TOKEN_BYTES)
        .then_some(token)
}

pub(super) fn now() -> std::time::Instant {
    // tokio's clock, so that tests with paused time control expiry.
    tokio::time::Instant::now().into_std()
}

/// Locks a cache; a panic while it was held left it consistent (every operation is one map
/// call), so the poison is ignored.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Middleware in front of the metrics route: passes the request on when [`MetricsAuth::check`]
/// allows it, and otherwise answers 401, 403 or 503 with a fixed body that repeats nothing of the
/// request.
pub(crate) async fn require_access(
    State(auth): State<Arc<MetricsAuth>>,
    request: Request,
    next: Next,
) -> Response {
    match auth.check(request.headers()).await {
        Ok(Access::Allowed) => next.run(request).await,
        Ok(Access::Unauthenticated) => unauthorized(),
        Ok(Access::Forbidden) => forbidden(),
        Err(error) => {
            tracing::warn!(event = records::EVENT_METRICS_REVIEW_FAILED, error = %format!("{error:#}"), "failed to review a metrics request");
            (StatusCode::SERVICE_UNAVAILABLE, UNAVAILABLE).into_response()
        }
    }
}

/// The answer to a request without a token the API server accepts.
fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        UNAUTHORIZED,
    )
        .into_response()
}

/// The answer to an authenticated user who may not read the metrics.
fn forbidden() -> Response {
    (StatusCode::FORBIDDEN, FORBIDDEN).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with_authorization(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(value).expect("header value"),
        );
        headers
    }

    #[test]
    fn bearer_tokens_are_read_as_kubernetes_reads_them() {
        assert_eq!(bearer_token(&HeaderMap::new()), None);
        assert_eq!(
            bearer_token(&with_authorization("Bearer abc.def")),
            Some("abc.def")
        );
        assert_eq!(
            bearer_token(&with_authorization("bearer  abc ")),
            Some("abc")
        );
        assert_eq!(
            bearer_token(&with_authorization("Basic dXNlcjpwdw==")),
            None
        );
        assert_eq!(bearer_token(&with_authorization("Bearer")), None);
        assert_eq!(bearer_token(&with_authorization("Bearer ")), None);
        let long = format!("Bearer {}", "a".repeat(MAX_TOKEN_BYTES + 1));
        assert_eq!(bearer_token(&with_authorization(&long)), None);
    }

    #[tokio::test]
    async fn refusals_say_nothing_about_the_request() {
        for (response, status, body) in [
            (unauthorized(), StatusCode::UNAUTHORIZED, UNAUTHORIZED),
            (forbidden(), StatusCode::FORBIDDEN, FORBIDDEN),
        ] {
            assert_eq!(response.status(), status);
            let bytes = axum::body::to_bytes(response.into_body(), 1024)
                .await
                .expect("body");
            assert_eq!(bytes, body.as_bytes());
        }
    }

    #[test]
    fn users_are_taken_whole_from_the_token_review() {
        let user = User::from(UserInfo {
            username: Some("system:serviceaccount:monitoring:prometheus".into()),
            uid: Some("1234".into()),
            groups: Some(vec!["system:serviceaccounts".into()]),
            extra: Some(BTreeMap::from([(
                "authentication.kubernetes.io/pod-name".to_string(),
                vec!["prometheus-0".to_string()],
            )])),
        });
        assert_eq!(user.name, "system:serviceaccount:monitoring:prometheus");
        assert_eq!(user.groups, ["system:serviceaccounts"]);
        assert_eq!(user.uid, "1234");
        assert_eq!(user.extra.len(), 1);
    }

    /// An API server that accepts the token "good" (for audience "metrics" when asked for
    /// audiences, and then names it), allows every user, and answers a review of any other token
    /// after `slow`; it counts the TokenReviews of each token.
    fn api_server(
        slow: Duration,
    ) -> (
        ReviewClients,
        Arc<Mutex<std::collections::HashMap<String, usize>>>,
    ) {
        use kube::client::Body;
        let counts = Arc::new(Mutex::new(std::collections::HashMap::new()));
        let seen = counts.clone();
        let service = tower::service_fn(move |request: axum::http::Request<Body>| {
            let seen = seen.clone();
            async move {
                let path = request.uri().path().to_string();
                let body = request
                    .into_body()
                    .collect_bytes()
                    .await
                    .expect("request body");
                let body: serde_json::Value = serde_json::from_slice(&body).expect("json");
                let answer = if path.contains("tokenreviews") {
                    let token = body["spec"]["token"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    *lock(&seen).entry(token.clone()).or_insert(0) += 1;
                    let audiences = body["spec"]["audiences"].as_array().cloned();
                    let good = token == "good"
                        && audiences
                            .as_ref()
                            .is_none_or(|a| a.iter().any(|a| a == "metrics"));
                    if !good {
                        tokio::time::sleep(slow).await;
                    }
                    serde_json::json!({
                        "apiVersion": "authentication.k8s.io/v1",
                        "kind": "TokenReview",
                        "spec": body["spec"],
                        "status": {
                            "authenticated": good,
                            "user": {"username": "scraper"},
                            "audiences": audiences.map(|_| vec!["metrics"]),
                        },
                    })
                } else {
                    serde_json::json!({
                        "apiVersion": "authorization.k8s.io/v1",
                        "kind": "SubjectAccessReview",
                        "spec": body["spec"],
                        "status": {"allowed": true},
                    })
                };
                axum::http::Response::builder()
                    .status(201)
                    .body(Body::from(serde_json::to_vec(&answer).expect("json")))
            }
        });
        let client = kube::Client::new(service, "default");
        let clients = ReviewClients {
            new_tokens: client.clone(),
            known: client,
        };
        (clients, counts)
    }

    fn bearer(token: &str) -> HeaderMap {
        with_authorization(&format!("Bearer {token}"))
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_are_cached_apart_and_never_push_a_scraper_out() {
        let (clients, counts) = api_server(Duration::ZERO);
        let auth = MetricsAuth::new(clients, Vec::new());
        assert_eq!(
            auth.check(&bearer("good")).await.ok(),
            Some(Access::Allowed)
        );
        for _ in 0..3 {
            assert_eq!(
                auth.check(&bearer("random")).await.ok(),
                Some(Access::Unauthenticated)
            );
        }
        // More refusals than the acceptance cache holds.
        for i in 0..MAX_ENTRIES + 10 {
            auth.check(&bearer(&format!("r{i}")))
                .await
                .expect("answered");
        }
        assert_eq!(
            auth.check(&bearer("good")).await.ok(),
            Some(Access::Allowed)
        );
        let counts = lock(&counts);
        assert_eq!(counts["random"], 1, "a refusal is remembered");
        assert_eq!(counts["good"], 1, "the scraper's answer stayed cached");
        assert!(lock(&auth.refused).len() <= MAX_REFUSED);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_random_tokens_does_not_starve_a_known_scraper() {
        let (clients, counts) = api_server(Duration::from_secs(1));
        let auth = Arc::new(MetricsAuth::new(clients, Vec::new()));
        assert_eq!(
            auth.check(&bearer("good")).await.ok(),
            Some(Access::Allowed)
        );
        // The scraper's cached answers expire.
        tokio::time::advance(ALLOWED_TTL + Duration::from_secs(1)).await;
        let flood: Vec<_> = (0..200)
            .map(|i| {
                let auth = auth.clone();
                tokio::spawn(async move { auth.check(&bearer(&format!("f{i}"))).await.is_ok() })
            })
            .collect();
        tokio::task::yield_now().await;
        let started = tokio::time::Instant::now();
        assert_eq!(
            auth.check(&bearer("good")).await.ok(),
            Some(Access::Allowed)
        );
        assert!(started.elapsed() < Duration::from_millis(100));
        let mut refused = 0;
        for request in flood {
            if !request.await.expect("joined") {
                refused += 1;
            }
        }
        // The flood's requests got 503 after their short wait, and cost only the reviews the
        // new-token lane had turns for.
        assert!(refused > 150, "{refused}");
        assert_eq!(lock(&counts)["good"], 2);
    }

    #[tokio::test(start_paused = true)]
    async fn with_audiences_only_tokens_for_them_are_accepted() {
        let (clients, _) = api_server(Duration::ZERO);
        let auth = MetricsAuth::new(clients, vec!["metrics".into()]);
        assert_eq!(
            auth.check(&bearer("good")).await.ok(),
            Some(Access::Allowed)
        );
        let (clients, _) = api_server(Duration::ZERO);
        let auth = MetricsAuth::new(clients, vec!["other".into()]);
        assert_eq!(
            auth.check(&bearer("good")).await.ok(),
            Some(Access::Unauthenticated)
        );
    }
}
