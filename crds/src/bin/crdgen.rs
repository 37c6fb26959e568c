//! Writes the `ClusterRing` and `ControllerRing` CRD YAML generated from the Rust types to
//! `config/crds/`.

use std::path::Path;

use kube_sharding_api::RingKind;
use kube_sharding_api::crd::{crd_path, ring_crd_yaml};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for kind in RingKind::ALL {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(crd_path(kind));
        std::fs::write(&path, ring_crd_yaml(kind)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
