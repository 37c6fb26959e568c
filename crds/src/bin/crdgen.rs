//! Writes the `ClusterRing` CRD YAML generated from the Rust types to `config/crds/`.

use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(sharding_crds::crd::CRD_PATH);
    std::fs::write(&path, sharding_crds::crd::cluster_ring_crd_yaml()?)?;
    println!("wrote {}", path.display());
    Ok(())
}
