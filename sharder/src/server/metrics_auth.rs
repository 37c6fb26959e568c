//! Who may read the metrics: the bearer token of every request is authenticated by the API server
//! (a TokenReview) and the user it names is authorized for `get` on the non-resource URL
//! `/metrics` (a SubjectAccessReview), as the API server itself and kubelet do for their own
//! metrics. A scraper therefore needs only its ServiceAccount token and a ClusterRole such as the
//! shipped `sharding:metrics-reader`.
//!
//! Both answers are cached for a short while, negative ones too, so a scraper that comes back
//! every 15 or 30 seconds costs the API server two reviews every couple of minutes rather than two
//! per scrape. The caches are bounded in entries and keep a hash of each token, never the token,
//! so a client sending random tokens cannot grow the sharder's memory; it can only cost one
//! TokenReview per request, a few at a time.

mod cache;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, UserInfo};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use self::cache::ExpiringCache;

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

/// Reviews sent at once. A client sending new tokens as fast as it can thus keeps only a few
/// API calls in flight; the rest wait their turn.
const MAX_REVIEWS_IN_FLIGHT: usize = 4;

/// How long a request waits for its reviews (a turn and the API call) before it is refused.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// No answer within [`REVIEW_TIMEOUT`].
    #[error("failed to get a review answered within {REVIEW_TIMEOUT:?}")]
    Timeout,
}

/// The user a token stands for, as the TokenReview named it: what the SubjectAccessReview asks
/// about, and the key of the authorization cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct User {
    name: String,
    uid: String,
    groups: Vec<String>,
    extra: BTreeMap<String, Vec<String>>,
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

/// Reviews of scrapers' tokens through the API server, with their answers cached (not `Debug`:
/// kube's `Client` is not).
pub(crate) struct MetricsAuth {
    client: Client,
    /// SHA-256 of a token → its user, or `None` when the token was rejected.
    tokens: Mutex<ExpiringCache<[u8; 32], Option<User>>>,
    /// User → whether it may read the metrics.
    access: Mutex<ExpiringCache<User, bool>>,
    reviews: Semaphore,
}

impl MetricsAuth {
    /// Reviews through `client`; its requests count as the client's own.
    pub(crate) fn new(client: Client) -> Self {
        Self {
            client,
            tokens: Mutex::new(ExpiringCache::new(MAX_ENTRIES)),
            access: Mutex::new(ExpiringCache::new(MAX_ENTRIES)),
            reviews: Semaphore::new(MAX_REVIEWS_IN_FLIGHT),
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

    /// The user `token` stands for, or `None` when the API server does not accept it.
    async fn authenticate(&self, token: &str) -> Result<Option<User>, ReviewError> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(known) = lock(&self.tokens).get(&key, now()) {
            return Ok(known);
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                // The API server's own audiences: a token made for another service is refused.
                audiences: None,
            },
            ..TokenReview::default()
        };
        let answer = self
            .review(
                Api::<TokenReview>::all(self.client.clone()),
                review,
                "TokenReview",
            )
            .await?;
        let user = answer
            .status
            .filter(|s| s.authenticated == Some(true))
            .and_then(|s| s.user)
            .map(User::from);
        let ttl = if user.is_some() {
            ALLOWED_TTL
        } else {
            DENIED_TTL
        };
        let now = now();
        lock(&self.tokens).insert(key, user.clone(), now + ttl, now);
        Ok(user)
    }

    /// Whether `user` may `get` the non-resource URL `/metrics`.
    async fn authorize(&self, user: &User) -> Result<bool, ReviewError> {
        if let Some(known) = lock(&self.access).get(user, now()) {
            return Ok(known);
        }
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.name.clone()),
                uid: Some(user.uid.clone()).filter(|u| !u.is_empty()),
                groups: Some(user.groups.clone()),
                extra: Some(user.extra.clone()),
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(METRICS_PATH.into()),
                    verb: Some("get".into()),
                }),
                resource_attributes: None,
            },
            ..SubjectAccessReview::default()
        };
        let answer = self
            .review(
                Api::<SubjectAccessReview>::all(self.client.clone()),
                review,
                "SubjectAccessReview",
            )
            .await?;
        let allowed = answer.status.is_some_and(|s| s.allowed);
        let ttl = if allowed { ALLOWED_TTL } else { DENIED_TTL };
        let now = now();
        lock(&self.access).insert(user.clone(), allowed, now + ttl, now);
        Ok(allowed)
    }

    /// Creates `review` and returns the API server's answer, waiting for a turn first.
    async fn review<K>(&self, api: Api<K>, review: K, kind: &'static str) -> Result<K, ReviewError>
    where
        K: kube::Resource
            + Clone
            + serde::Serialize
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        tokio::time::timeout(REVIEW_TIMEOUT, async {
            let _turn = self.reviews.acquire().await;
            api.create(&PostParams::default(), &review)
                .await
                .map_err(|source| ReviewError::Api { kind, source })
        })
        .await
        .map_err(|_| ReviewError::Timeout)?
    }
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

fn now() -> std::time::Instant {
    // tokio's clock, so that tests with paused time control expiry.
    tokio::time::Instant::now().into_std()
}

/// Locks a cache; a panic while it was held left it consistent (every operation is one map
/// call), so the poison is ignored.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
            tracing::warn!(error = %format!("{error:#}"), "failed to review a metrics request");
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
}
