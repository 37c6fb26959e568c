//! Lists one resource page by page for a sync, metadata only, and survives continue tokens that
//! expire while the sync works through a page.
//!
//! A continue token pins the revision of the list's first page. When etcd has compacted that
//! revision away before the next page is asked for (the API server compacts every 5 minutes by
//! default, and a page of 500 patches can take longer on a busy cluster), the API server answers
//! **410 Gone**. Its Status then usually carries a fresh token in `metadata.continue` that resumes
//! after the last key returned, read at the current revision: an *inconsistent continuation*
//! (Kubernetes API concepts, "Retrieving large results sets in chunks"). A sync needs no
//! consistent snapshot, since every patch is guarded by the object's own `resourceVersion`, so
//! the pager resumes with that token. Without one, it starts the list over from the first page,
//! at most [`MAX_RESTARTS`] times, so a list that keeps expiring fails the sync with a clear error
//! instead of looping.

use kube::api::{Api, DynamicObject, ListParams};
use kube::core::PartialObjectMeta;

use crate::core::list_scope::PAGE_SIZE;

/// How often one list may start over from its first page (410 Gone with no token to resume
/// from) before the sync gives up on it.
pub(crate) const MAX_RESTARTS: u32 = 3;

/// How many 410 Gone answers in a row, with no page between them, end the list. A token from a
/// 410 resumes at the current revision, which cannot be compacted yet, so a second 410 in a row
/// is already unusual.
const MAX_EXPIRED_IN_A_ROW: u32 = 5;

/// One page of a list and what it took to get it.
#[derive(Debug)]
pub(crate) struct Page {
    /// The page's objects.
    pub(crate) items: Vec<PartialObjectMeta<DynamicObject>>,
    /// The list started over from its first page before this page: whatever earlier pages of
    /// this list counted is counted again.
    pub(crate) restarted: bool,
    /// Expired continue tokens replaced by the token of their 410 answer before this page.
    pub(crate) inconsistent_continuations: u32,
}

/// A list that could not be read to its end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PagerError {
    /// A page request failed (other than an expired continue token).
    #[error(transparent)]
    Api(kube::Error),
    /// Continue tokens expired with no token to resume from, and the list started over too
    /// often.
    #[error(
        "the list's continue token expired {expired} times (410 Gone) and it started over {restarts} times; giving up until the next sync"
    )]
    Expired {
        /// Times the list started over from the first page.
        restarts: u32,
        /// 410 answers in a row when giving up.
        expired: u32,
    },
}

/// Where the next request starts.
#[derive(Debug)]
enum Next {
    First,
    Continue(String),
    Done,
}

/// The pages of one list, requested one at a time with [`Pager::next_page`].
#[derive(Debug)]
pub(crate) struct Pager {
    api: Api<DynamicObject>,
    next: Next,
    restarts: u32,
}

impl Pager {
    /// The pages of every object `api` lists (one namespace or the whole cluster).
    pub(crate) fn new(api: Api<DynamicObject>) -> Self {
        Self {
            api,
            next: Next::First,
            restarts: 0,
        }
    }

    /// The next page, or `None` after the last one.
    ///
    /// Pages are consistent reads without a `resourceVersion`, deliberately unlike
    /// docs/protocol.md §9 (`resourceVersion=0`): the API server ignores `limit` for
    /// `resourceVersion=0` and returns every object in one page with no continue token (still so
    /// on 1.37), which would make the sharder's memory grow with the ring. kube drops
    /// `resourceVersion=0` from limited lists for the same reason. API servers whose watch cache
    /// serves paginated lists (1.37's `ListFromCacheSnapshot`) answer these pages from the cache
    /// as well; others read them from etcd. Later pages pass only the continue token, as the API
    /// requires.
    pub(crate) async fn next_page(&mut self) -> Result<Option<Page>, PagerError> {
        let mut restarted = false;
        let mut inconsistent_continuations = 0;
        let mut expired = 0;
        loop {
            let mut params = ListParams::default().limit(PAGE_SIZE);
            match &self.next {
                Next::First => {}
                Next::Continue(token) => params.continue_token = Some(token.clone()),
                Next::Done => return Ok(None),
            }
            match self.api.list_metadata(&params).await {
                Ok(list) => {
                    self.next = match list.metadata.continue_.filter(|c| !c.is_empty()) {
                        Some(token) => Next::Continue(token),
                        None => Next::Done,
                    };
                    return Ok(Some(Page {
                        items: list.items,
                        restarted,
                        inconsistent_continuations,
                    }));
                }
                Err(kube::Error::Api(status)) if status.code == 410 => {
                    expired += 1;
                    let token = status
                        .metadata
                        .and_then(|m| m.continue_)
                        .filter(|c| !c.is_empty());
                    match token {
                        Some(token) if expired <= MAX_EXPIRED_IN_A_ROW => {
                            inconsistent_continuations += 1;
                            self.next = Next::Continue(token);
                        }
                        None if self.restarts < MAX_RESTARTS && expired <= MAX_EXPIRED_IN_A_ROW => {
                            self.restarts += 1;
                            restarted = true;
                            self.next = Next::First;
                        }
                        _ => {
                            return Err(PagerError::Expired {
                                restarts: self.restarts,
                                expired,
                            });
                        }
                    }
                }
                Err(error) => return Err(PagerError::Api(error)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use axum::http::{Request, Response};
    use kube::client::Body;
    use kube::core::ApiResource;
    use serde_json::{Value, json};

    use super::*;

    /// A client whose API server answers each request with the next of `answers` (status code
    /// and JSON body) and records the query string of each request.
    fn client(answers: Vec<(u16, Value)>) -> (kube::Client, Arc<Mutex<Vec<String>>>) {
        let answers = Arc::new(Mutex::new(VecDeque::from(answers)));
        let queries = Arc::new(Mutex::new(Vec::new()));
        let seen = queries.clone();
        let service = tower::service_fn(move |request: Request<Body>| {
            let answer = answers.lock().expect("answers").pop_front();
            seen.lock()
                .expect("queries")
                .push(request.uri().query().unwrap_or_default().to_string());
            async move {
                let (code, body) = answer.expect("no more answers");
                Response::builder()
                    .status(code)
                    .body(Body::from(serde_json::to_vec(&body).expect("json")))
            }
        });
        (kube::Client::new(service, "default"), queries)
    }

    fn pager(client: kube::Client) -> Pager {
        let ar = ApiResource {
            group: String::new(),
            version: "v1".into(),
            api_version: "v1".into(),
            kind: "Secret".into(),
            plural: "secrets".into(),
        };
        Pager::new(Api::all_with(client, &ar))
    }

    fn page(names: &[&str], token: Option<&str>) -> (u16, Value) {
        let items: Vec<Value> = names
            .iter()
            .map(|n| json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": n, "namespace": "a"}}))
            .collect();
        let metadata = match token {
            Some(token) => json!({"resourceVersion": "10", "continue": token}),
            None => json!({"resourceVersion": "10"}),
        };
        (
            200,
            json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": metadata, "items": items}),
        )
    }

    /// A 410 Gone Status as the API server sends it for an expired continue token, with the
    /// token of an inconsistent continuation when given.
    fn gone(token: Option<&str>) -> (u16, Value) {
        let mut status = json!({
            "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 410,
            "reason": "Expired",
            "message": "The provided continue parameter is too old to display a consistent list result.",
            "metadata": {},
        });
        if let Some(token) = token {
            status["metadata"]["continue"] = token.into();
        }
        (410, status)
    }

    fn names(page: &Page) -> Vec<String> {
        page.items
            .iter()
            .map(|o| o.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    #[tokio::test]
    async fn an_expired_token_is_replaced_by_the_one_its_410_carries() {
        let (client, queries) = client(vec![
            page(&["s-1"], Some("first")),
            gone(Some("inconsistent")),
            page(&["s-2"], Some("second")),
            page(&["s-3"], None),
        ]);
        let mut pager = pager(client);
        let first = pager.next_page().await.expect("page").expect("some");
        assert_eq!(
            (
                names(&first),
                first.restarted,
                first.inconsistent_continuations
            ),
            (vec!["s-1".to_string()], false, 0)
        );
        let second = pager.next_page().await.expect("page").expect("some");
        assert_eq!(
            (
                names(&second),
                second.restarted,
                second.inconsistent_continuations
            ),
            (vec!["s-2".to_string()], false, 1)
        );
        let third = pager.next_page().await.expect("page").expect("some");
        assert_eq!(third.inconsistent_continuations, 0);
        assert!(pager.next_page().await.expect("end").is_none());
        let queries = queries.lock().expect("queries").clone();
        assert_eq!(queries.len(), 4);
        assert!(!queries[0].contains("continue="), "{queries:?}");
        assert!(queries[1].contains("continue=first"), "{queries:?}");
        assert!(queries[2].contains("continue=inconsistent"), "{queries:?}");
        assert!(queries[3].contains("continue=second"), "{queries:?}");
        assert!(
            queries
                .iter()
                .all(|q| q.contains("limit=500") && !q.contains("resourceVersion")),
            "{queries:?}"
        );
    }

    #[tokio::test]
    async fn an_expired_token_without_a_successor_starts_the_list_over() {
        let (client, queries) = client(vec![
            page(&["s-1"], Some("first")),
            gone(None),
            page(&["s-1"], Some("again")),
            page(&["s-2"], None),
        ]);
        let mut pager = pager(client);
        let first = pager.next_page().await.expect("page").expect("some");
        assert!(!first.restarted);
        let again = pager.next_page().await.expect("page").expect("some");
        assert_eq!(
            (names(&again), again.restarted),
            (vec!["s-1".to_string()], true)
        );
        let last = pager.next_page().await.expect("page").expect("some");
        assert!(!last.restarted);
        assert!(pager.next_page().await.expect("end").is_none());
        let queries = queries.lock().expect("queries").clone();
        assert!(!queries[2].contains("continue="), "{queries:?}");
        assert!(queries[3].contains("continue=again"), "{queries:?}");
    }

    #[tokio::test]
    async fn a_list_that_keeps_expiring_gives_up_after_bounded_restarts() {
        // Every continuation expires without a token: the first page is read once, then again
        // after each restart, and the list gives up instead of looping.
        let mut answers = vec![page(&["s-1"], Some("t"))];
        for _ in 0..MAX_RESTARTS {
            answers.push(gone(None));
            answers.push(page(&["s-1"], Some("t")));
        }
        answers.push(gone(None));
        let (client, queries) = client(answers);
        let mut pager = pager(client);
        let mut restarts = 0;
        let error = loop {
            match pager.next_page().await {
                Ok(Some(page)) => restarts += u32::from(page.restarted),
                Ok(None) => panic!("the list cannot end"),
                Err(error) => break error,
            }
        };
        assert_eq!(restarts, MAX_RESTARTS);
        assert!(
            matches!(error, PagerError::Expired { restarts, .. } if restarts == MAX_RESTARTS),
            "{error}"
        );
        assert!(error.to_string().contains("410 Gone"), "{error}");
        assert_eq!(
            queries.lock().expect("queries").len(),
            2 * MAX_RESTARTS as usize + 2
        );
    }

    #[tokio::test]
    async fn other_errors_are_returned_as_they_are() {
        let (client, _) = client(vec![(
            404,
            json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 404, "reason": "NotFound", "message": "not found"}),
        )]);
        let mut pager = pager(client);
        let error = pager.next_page().await.expect_err("404");
        assert!(
            matches!(&error, PagerError::Api(kube::Error::Api(status)) if status.code == 404),
            "{error}"
        );
    }
}
