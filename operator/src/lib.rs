//! kvfabric-operator: the `KvFabric` CRD and the controller that turns pod
//! lifecycle into peer lifecycle (issue 14).
//!
//! Layout (pure first, IO last):
//! * [`crd`] — the `KvFabric` resource, its schema (CEL rules) and the YAML
//!   `crdgen` writes to `crds/`;
//! * [`decide`] — pure: pod/node state → keep or invalidate;
//! * [`index`] — pure: watch events (init/resync/delete) → invalidations;
//! * [`leader`] — leader election on a Lease (pure rule + IO);
//! * [`store`] — the fabric's etcd keys (record removal, tombstones);
//! * [`controller`] — watches, wiring, status;
//! * [`reports`] — polls agents' `/v1/report` (Transferring, TransportDegraded);
//! * [`metrics`] — Prometheus metrics and `/metrics`.

pub mod controller;
pub mod crd;
pub mod decide;
pub mod index;
pub mod leader;
pub mod metrics;
pub mod reports;
pub mod store;
