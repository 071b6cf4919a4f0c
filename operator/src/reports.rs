//! Polls the fabric's agents for their [`AgentReport`] (`GET /v1/report`
//! on the HTTP address each publishes in its etcd record), for the
//! `Transferring` and `TransportDegraded` conditions. IO only; the reading
//! is [`kvfabric_core::report::fleet_view`].

use std::collections::BTreeMap;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvfabric_core::report::AgentReport;

use crate::store::FabricStore;

/// How often a fabric task polls its agents.
pub const POLL_INTERVAL: Duration = Duration::from_secs(5);
/// Bound on one agent's answer (a hung agent does not hold the poll).
pub const AGENT_TIMEOUT: Duration = Duration::from_secs(1);
/// Largest report body read, bytes.
const MAX_REPORT_BYTES: usize = 64 * 1024;

/// One poll of the fabric's agents.
#[derive(Clone, Debug, Default)]
pub struct Poll {
    /// The agents with a record now (`None`: the records could not be
    /// read from etcd).
    pub agents: Option<Vec<String>>,
    /// Reports of the agents that answered within [`AGENT_TIMEOUT`], by
    /// agent name (agents that do not answer, answer non-200 or with a
    /// body that is not a report are left out, logged at debug).
    pub reports: BTreeMap<String, AgentReport>,
}

/// Polls every agent of the fabric once. Never fails: an unreadable agent
/// list is a [`Poll`] with `agents: None`.
pub async fn poll(store: &FabricStore) -> Poll {
    let agents = match store.agent_http_urls().await {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(error = %e, "agent reports: cannot list agents");
            return Poll::default();
        }
    };
    let names: Vec<String> = agents.iter().map(|(n, _)| n.clone()).collect();
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let polls = agents.into_iter().map(|(name, url)| {
        let client = client.clone();
        async move {
            let uri: hyper::Uri = format!("{}/v1/report", url.trim_end_matches('/'))
                .parse()
                .ok()?;
            let fetch = async {
                let resp = client.get(uri).await.ok()?;
                if !resp.status().is_success() {
                    return None;
                }
                let body = http_body_util::Limited::new(resp.into_body(), MAX_REPORT_BYTES)
                    .collect()
                    .await
                    .ok()?
                    .to_bytes();
                serde_json::from_slice::<AgentReport>(&body).ok()
            };
            match tokio::time::timeout(AGENT_TIMEOUT, fetch).await {
                Ok(Some(r)) if r.agent == name => Some((name, r)),
                other => {
                    tracing::debug!(agent = %name, answered = other.is_ok(), "no report from agent");
                    None
                }
            }
        }
    });
    Poll {
        agents: Some(names),
        reports: futures::future::join_all(polls)
            .await
            .into_iter()
            .flatten()
            .collect(),
    }
}
