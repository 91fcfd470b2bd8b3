//! Waiting for the node agent's decommission request (`helm uninstall`'s pre-delete
//! hook, docs/operations.md "Uninstall"), shared by the speaker and the BFD daemon.

use std::path::PathBuf;

use juneau_control::decommission;

/// How often the request directory is looked at (a stat).
pub const POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Resolves with the request's token once the node agent's decommission request stands
/// in `dir`; never without a directory.
pub async fn requested(dir: Option<PathBuf>) -> String {
    let Some(dir) = dir else {
        return std::future::pending().await;
    };
    loop {
        if let Some(token) = decommission::requested(&dir) {
            return token;
        }
        tokio::time::sleep(POLL).await;
    }
}
