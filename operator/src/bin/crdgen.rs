//! Writes the `KvFabric` CRD YAML: to the path given as the first argument
//! (`crds/kvfabric.io_kvfabrics.yaml` from the repository root by
//! convention), or to stdout with no argument or `-`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let yaml = match kvfabric_operator::crd::crd_yaml() {
        Ok(y) => y,
        Err(e) => {
            eprintln!("crdgen: cannot serialize the CRD: {e}");
            return ExitCode::FAILURE;
        }
    };
    match std::env::args().nth(1).as_deref() {
        None | Some("-") => print!("{yaml}"),
        Some(path) => {
            if let Err(e) = std::fs::write(path, yaml) {
                eprintln!("crdgen: cannot write {path}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
