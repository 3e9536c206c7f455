//! Heartbeats: every peer hears from us at least every `heartbeat_interval_ms`, and a
//! peer we do not hear from for `heartbeat_interval_ms x heartbeat_misses` is lost; so
//! is a peer whose setup outlives `bootstrap_timeout_ms`, or whose control queue
//! overflowed.

use std::sync::atomic::Ordering;

use super::Control;
use crate::proto::Message;

impl Control {
    /// Watchdog duty: send heartbeats that are due and lose silent peers.
    pub fn heartbeat(&self) {
        let node = &self.node;
        let config = &node.config;
        let now = node.now_ms();
        let limit = config.heartbeat_interval_ms * config.heartbeat_misses as u64;
        for p in self.peers() {
            if p.is_lost() {
                continue;
            }
            if let Some(why) = p.doomed() {
                self.lose(&p, why);
                continue;
            }
            if !p.is_ready() {
                // Each step of a setup has its own timeout; the whole of it has this one,
                // so that a peer that answers slowly, step by step, cannot keep every
                // room to it waiting for a setup that never ends.
                let setup = now.saturating_sub(p.since_ms);
                if setup > config.bootstrap_timeout_ms {
                    self.lose(
                        &p,
                        format!(
                            "its setup did not finish within bootstrap_timeout_ms={}",
                            config.bootstrap_timeout_ms
                        ),
                    );
                }
                continue;
            }
            let silent = now.saturating_sub(p.last_recv_ms.load(Ordering::Relaxed));
            if silent > limit {
                self.lose(
                    &p,
                    format!(
                        "no frame for {silent} ms (heartbeat_interval_ms={} x heartbeat_misses={})",
                        config.heartbeat_interval_ms, config.heartbeat_misses
                    ),
                );
                continue;
            }
            if now.saturating_sub(p.last_sent_ms.load(Ordering::Relaxed))
                >= config.heartbeat_interval_ms
            {
                let seq = p.hb_seq.fetch_add(1, Ordering::Relaxed);
                p.send(&Message::Heartbeat { seq });
            }
        }
    }
}
