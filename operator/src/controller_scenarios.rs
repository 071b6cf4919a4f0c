//! `tower-test` scenarios of the controller's API calls (issue 14, item 6:
//! kube-rs controller-rs style). The kube client talks to a mock service;
//! each scenario answers exactly the calls it expects, checks method, path,
//! patch type and body, and fails on a missing call (a bounded wait) or an
//! unexpected extra one.

use std::time::Duration;

use http::{Method, Request, Response};
use kube::client::Body;
use kube::Client;
use serde_json::{json, Value};
use tower_test::mock::{self, Handle};

use super::*;
use crate::crd::KvFabric;

type ApiHandle = Handle<Request<Body>, Response<Body>>;

/// A client over a mock service, and the scenario's end of it.
fn mock_client() -> (Client, ApiHandle) {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(svc, "default"), handle)
}

/// Waits (2 s) for the next call, checks its method and path, answers it
/// with `status` and `reply`, and returns its body as JSON (`Null` when
/// empty) and its content type.
async fn expect(
    handle: &mut ApiHandle,
    method: Method,
    path: &str,
    status: u16,
    reply: Value,
) -> (Value, String) {
    let (req, send) = tokio::time::timeout(Duration::from_secs(2), handle.next_request())
        .await
        .unwrap_or_else(|_| panic!("missing call: {method} {path}"))
        .expect("the client is gone");
    assert_eq!(req.method(), method, "method of {}", req.uri());
    assert_eq!(req.uri().path(), path);
    let ctype = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let bytes = req.into_body().collect_bytes().await.expect("request body");
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("JSON request body")
    };
    send.send_response(
        Response::builder()
            .status(status)
            .body(Body::from(serde_json::to_vec(&reply).unwrap()))
            .unwrap(),
    );
    (body, ctype)
}

/// Fails when the client makes another call within 200 ms.
async fn expect_no_more(handle: &mut ApiHandle) {
    if let Ok(Some((req, _))) =
        tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await
    {
        panic!("unexpected call: {} {}", req.method(), req.uri());
    }
}

fn fabric(finalizers: Option<Vec<&str>>, tls: Option<&str>) -> KvFabric {
    let mut f: KvFabric = serde_json::from_value(json!({
        "apiVersion": "kvfabric.io/v1alpha1", "kind": "KvFabric",
        "metadata": {"name": "f1", "namespace": "default", "uid": "u-1", "generation": 2},
        "spec": {
            "agentSelector": {"matchLabels": {"app": "a"}},
            "prefillSelector": {"matchLabels": {"role": "p"}},
            "decodeSelector": {"matchLabels": {"role": "d"}},
            "etcd": {"endpoints": ["https://etcd:2379"]}
        }
    }))
    .expect("KvFabric");
    f.metadata.finalizers = finalizers.map(|v| v.into_iter().map(String::from).collect());
    f.spec.etcd.tls_secret_ref = tls.map(String::from);
    f
}

const FABRIC_PATH: &str = "/apis/kvfabric.io/v1alpha1/namespaces/default/kvfabrics/f1";

#[tokio::test]
async fn the_finalizer_is_added_with_one_json_patch() {
    // No finalizers yet: the list is created.
    let (client, mut handle) = mock_client();
    let f = fabric(None, None);
    let call = tokio::spawn(async move { add_finalizer(&client, &f).await });
    let reply = serde_json::to_value(fabric(Some(vec![FINALIZER]), None)).unwrap();
    let (body, ctype) = expect(&mut handle, Method::PATCH, FABRIC_PATH, 200, reply.clone()).await;
    assert_eq!(ctype, "application/json-patch+json");
    assert_eq!(
        body,
        json!([{"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}])
    );
    call.await.unwrap().expect("patched");
    expect_no_more(&mut handle).await;

    // Another controller's finalizer is kept: ours is appended.
    let (client, mut handle) = mock_client();
    let f = fabric(Some(vec!["example.com/other"]), None);
    let call = tokio::spawn(async move { add_finalizer(&client, &f).await });
    let (body, _) = expect(&mut handle, Method::PATCH, FABRIC_PATH, 200, reply).await;
    assert_eq!(
        body,
        json!([{"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER}])
    );
    call.await.unwrap().expect("patched");
    expect_no_more(&mut handle).await;
}

#[tokio::test]
async fn status_goes_through_the_status_subresource_as_a_merge_patch() {
    let (client, mut handle) = mock_client();
    let api: Api<KvFabric> = Api::namespaced(client, "default");
    let t = Time(k8s_openapi::jiff::Timestamp::from_second(100).unwrap());
    let rollout = RolloutStatus {
        known: true,
        generation: 4,
        fingerprint: "00ff".into(),
        at_desired: 2,
        total: 3,
        ..Default::default()
    };
    let status = KvFabricStatus {
        observed_generation: Some(2),
        config_generation: Some(4),
        agents_at_desired_generation: 2,
        agent_records: 3,
        conditions: conditions(2, None, None, &rollout, &FleetStatus::default(), &[], &t),
        ..Default::default()
    };
    let sent = status.clone();
    let call = tokio::spawn(async move { patch_status(&api, "f1", &sent).await });
    let reply = serde_json::to_value(fabric(None, None)).unwrap();
    let (body, ctype) = expect(
        &mut handle,
        Method::PATCH,
        &format!("{FABRIC_PATH}/status"),
        200,
        reply,
    )
    .await;
    assert_eq!(ctype, "application/merge-patch+json");
    let got: KvFabricStatus =
        serde_json::from_value(body["status"].clone()).expect("a KvFabricStatus");
    assert_eq!(got, status);
    let progressing = got
        .conditions
        .iter()
        .find(|c| c.type_ == "Progressing")
        .unwrap();
    assert_eq!(progressing.reason, "RollingOut");
    call.await.unwrap().expect("patched");
    expect_no_more(&mut handle).await;
}

#[tokio::test]
async fn etcd_tls_reads_the_named_secret_once_and_names_a_missing_key() {
    use k8s_openapi::ByteString;
    let secret = |keys: &[&str]| {
        let data: std::collections::BTreeMap<String, ByteString> = keys
            .iter()
            .map(|k| {
                let pem = format!("-----BEGIN X-----\n{k}\n-----END X-----\n");
                (k.to_string(), ByteString(pem.into_bytes()))
            })
            .collect();
        serde_json::to_value(Secret {
            metadata: kube::api::ObjectMeta {
                name: Some("etcd-client".into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            data: Some(data),
            ..Default::default()
        })
        .unwrap()
    };
    const SECRET_PATH: &str = "/api/v1/namespaces/default/secrets/etcd-client";

    // Complete Secret: the PEMs come back as given.
    let (client, mut handle) = mock_client();
    let f = fabric(None, Some("etcd-client"));
    let call = tokio::spawn(async move { etcd_tls(&client, &f).await });
    let (body, _) = expect(
        &mut handle,
        Method::GET,
        SECRET_PATH,
        200,
        secret(&["ca.crt", "tls.crt", "tls.key"]),
    )
    .await;
    assert_eq!(body, Value::Null);
    let tls = call.await.unwrap().expect("TLS material").expect("some");
    assert!(String::from_utf8_lossy(&tls.ca_pem).contains("ca.crt"));
    assert!(String::from_utf8_lossy(&tls.key_pem).contains("tls.key"));
    expect_no_more(&mut handle).await;

    // A key missing: the error names the Secret and the key.
    let (client, mut handle) = mock_client();
    let f = fabric(None, Some("etcd-client"));
    let call = tokio::spawn(async move { etcd_tls(&client, &f).await });
    expect(
        &mut handle,
        Method::GET,
        SECRET_PATH,
        200,
        secret(&["ca.crt", "tls.crt"]),
    )
    .await;
    let e = call.await.unwrap().expect_err("tls.key missing");
    assert!(
        e.contains("default/etcd-client") && e.contains("tls.key"),
        "{e}"
    );

    // The Secret is gone: an error naming it, not a panic or a hang.
    let (client, mut handle) = mock_client();
    let f = fabric(None, Some("etcd-client"));
    let call = tokio::spawn(async move { etcd_tls(&client, &f).await });
    expect(
        &mut handle,
        Method::GET,
        SECRET_PATH,
        404,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
               "message": "secrets \"etcd-client\" not found", "reason": "NotFound", "code": 404}),
    )
    .await;
    let e = call.await.unwrap().expect_err("not found");
    assert!(e.contains("default/etcd-client"), "{e}");

    // No Secret named: no API call at all.
    let (client, mut handle) = mock_client();
    let f = fabric(None, None);
    assert!(etcd_tls(&client, &f).await.unwrap().is_none());
    expect_no_more(&mut handle).await;
}
