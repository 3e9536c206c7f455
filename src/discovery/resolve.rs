//! Rooms by instance: a prefill instance's ranks from the discovery cache, checked to
//! pair with this engine.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use super::entry::Entry;
use super::live::Discovery;
use crate::config::Role;
use crate::control::pairing;
use crate::err;
use crate::error::Result;

impl Discovery {
    /// The addresses of every rank of prefill instance `instance`, in rank order, each
    /// checked to pair with this engine's KV registration as the registration exchange
    /// will check it. Reads only the cache.
    pub fn resolve(&self, instance: &str) -> Result<Vec<String>> {
        let cache = self.cache.lock();
        let mut ranks: BTreeMap<u32, &Entry> = BTreeMap::new();
        for c in cache.entries.values() {
            let e = &c.entry;
            if e.role == Role::Prefill && e.instance == instance {
                ranks.insert(e.rank, e);
            }
        }
        let Some(first) = ranks.values().next() else {
            let mut known: Vec<&str> = cache
                .entries
                .values()
                .filter(|c| c.entry.role == Role::Prefill)
                .map(|c| c.entry.instance.as_str())
                .collect();
            known.sort_unstable();
            known.dedup();
            let synced = if self.synced.load(Ordering::Acquire) {
                String::new()
            } else {
                " (the registry has not been read yet: etcd has not answered since this \
                 engine started)"
                    .to_string()
            };
            return Err(err!(
                NotFound,
                "no prefill instance '{instance}' in the registry ({} under {}){synced}; \
                 prefill instances known: [{}]",
                self.etcd.describe(),
                self.prefix,
                known.join(", ")
            ));
        };
        let n = first.ranks;
        if let Some(other) = ranks.values().find(|e| e.ranks != n) {
            return Err(err!(
                InvalidArgument,
                "prefill instance '{instance}': its ranks disagree on how many there are \
                 (rank {} says {n}, rank {} says {})",
                first.rank,
                other.rank,
                other.ranks
            ));
        }
        let missing: Vec<String> = (0..n)
            .filter(|r| !ranks.contains_key(r))
            .map(|r| r.to_string())
            .collect();
        if !missing.is_empty() {
            return Err(err!(
                NotFound,
                "prefill instance '{instance}' is not whole in the registry: rank(s) {} of \
                 {n} missing",
                missing.join(", ")
            ));
        }
        let ours = self.control.own_registration();
        for e in ranks.values() {
            pairing::pair_kv(&ours, &e.registration).map_err(|why| {
                err!(
                    InvalidArgument,
                    "prefill instance '{instance}' rank {} ({}) cannot pair with this engine: \
                     {why}",
                    e.rank,
                    e.address
                )
            })?;
        }
        Ok(ranks.values().map(|e| e.address.clone()).collect())
    }
}
