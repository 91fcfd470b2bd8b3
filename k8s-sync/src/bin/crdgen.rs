//! Prints Juneau's CustomResourceDefinitions as YAML (the content of `deploy/crds/`).

fn main() -> anyhow::Result<()> {
    print!("{}", juneau_k8s_sync::crd::crds_yaml()?);
    Ok(())
}
