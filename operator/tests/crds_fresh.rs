//! `crds/` must be what `crdgen` writes now (regenerate with
//! `cargo run -p kvfabric-operator --bin crdgen -- crds/kvfabric.io_kvfabrics.yaml`).

use std::path::Path;

#[test]
fn crds_dir_is_not_stale() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(kvfabric_operator::crd::CRD_PATH);
    let on_disk = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run crdgen)", path.display()));
    let generated = kvfabric_operator::crd::crd_yaml().expect("CRD serializes");
    assert!(
        on_disk == generated,
        "{} is stale: run `cargo run -p kvfabric-operator --bin crdgen -- {}`",
        path.display(),
        kvfabric_operator::crd::CRD_PATH
    );
}
