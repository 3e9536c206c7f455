//! Discovery: engines that find each other through etcd (config key `discovery`).
//!
//! Each engine publishes one entry under a lease that it keeps alive (`registrar`), and
//! watches every entry of the cluster's prefix into a local cache (`watcher`): a decode
//! room can then name a prefill instance instead of addresses
//! ([`Discovery::resolve`]), and a peer whose entry leaves the registry (its lease
//! expired, it was deleted, or a new incarnation replaced it) is lost at once, failing
//! its rooms with a reason naming the registry. Entries are signed with the cluster key
//! ([`entry`]); those that do not verify are ignored and counted.
//!
//! The registry is never on the data path: the scheduler's calls read only the cache;
//! etcd is reached only by the two threads here, which log, count and retry with backoff
//! while it is away, and register again when it is back.
//!
//! Built with the cargo feature `discovery` (on by default); without it, an engine
//! configured with `discovery` fails to start with `Unsupported`.

#[cfg(feature = "discovery")]
mod entry;
#[cfg(feature = "discovery")]
mod etcd;
#[cfg(feature = "discovery")]
mod http;
#[cfg(feature = "discovery")]
mod live;
#[cfg(feature = "discovery")]
mod resolve;

use std::sync::Arc;

use crate::control::Control;
use crate::error::Result;
use crate::node::Node;

#[cfg(feature = "discovery")]
pub(crate) use live::Discovery;

/// Without the feature no discovery can exist: a type without values.
#[cfg(not(feature = "discovery"))]
pub(crate) enum Discovery {}

#[cfg(not(feature = "discovery"))]
impl Discovery {
    pub fn resolve(&self, _instance: &str) -> Result<Vec<String>> {
        match *self {}
    }
    pub fn wake(&self) {
        match *self {}
    }
}

/// Starts discovery for an engine whose config sets `discovery`; `None` when it does
/// not. Checks the discovery keys: a cluster key (entries are signed with it), an
/// instance name, a rank below the instance's ranks.
pub(crate) fn start(node: &Arc<Node>, control: &Arc<Control>) -> Result<Option<Arc<Discovery>>> {
    let c = &node.config;
    if c.discovery.is_empty() {
        return Ok(None);
    }
    #[cfg(not(feature = "discovery"))]
    {
        let _ = control;
        Err(crate::err!(
            Unsupported,
            "config key 'discovery' is set, but this build of libkvxfer has no discovery \
             (cargo feature 'discovery')"
        ))
    }
    #[cfg(feature = "discovery")]
    {
        if c.auth_key.is_none() {
            return Err(crate::err!(
                BadValue,
                "config key 'discovery' needs the cluster key ('auth_key_file' or 'auth_key'): \
                 registry entries are signed with it, and entries that do not verify are \
                 ignored"
            ));
        }
        if c.instance.is_empty() {
            return Err(crate::err!(
                BadValue,
                "config key 'discovery' needs 'instance': the name this engine's instance \
                 is registered under"
            ));
        }
        if c.rank >= c.instance_ranks {
            return Err(crate::err!(
                BadValue,
                "config key 'rank' is {} but 'instance_ranks' is {}: ranks are 0 to {}",
                c.rank,
                c.instance_ranks,
                c.instance_ranks - 1
            ));
        }
        Discovery::start(node.clone(), control.clone()).map(Some)
    }
}
