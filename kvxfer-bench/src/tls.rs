//! `--tls`: a CA and the two engines' certificates, made for one run by the decode
//! side and handed to the prefill side with the plan (as `--auth` hands its key), then
//! written to private files for the engine to read at its start.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use serde::{Deserialize, Serialize};

/// The PEM texts of one run's CA and engine certificates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TlsPem {
    ca: String,
    /// (certificate, key) of the prefill and of the decode engine.
    prefill: (String, String),
    decode: (String, String),
}

fn rc(e: rcgen::Error) -> String {
    format!("cannot make the run's certificates: {e}")
}

impl TlsPem {
    /// A fresh CA (ECDSA P-256) and a certificate for each engine.
    pub fn fresh() -> Result<TlsPem, String> {
        let ca_key = KeyPair::generate().map_err(rc)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(rc)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "kvxfer-bench run CA");
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        let ca = params.self_signed(&ca_key).map_err(rc)?;
        let issue = |name: &str| -> Result<(String, String), String> {
            let key = KeyPair::generate().map_err(rc)?;
            let mut params = CertificateParams::new(vec!["kvxfer".to_string()]).map_err(rc)?;
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let cert = params.signed_by(&key, &ca, &ca_key).map_err(rc)?;
            Ok((cert.pem(), key.serialize_pem()))
        };
        Ok(TlsPem {
            ca: ca.pem(),
            prefill: issue("kvxfer-bench prefill")?,
            decode: issue("kvxfer-bench decode")?,
        })
    }

    /// Writes the files of engine `role` into a private directory of this process and
    /// sets the three `tls_*` keys through `set`; the directory is removed on drop of the
    /// returned guard (the engine reads the files when it starts).
    pub fn configure(
        &self,
        role: &str,
        set: &mut dyn FnMut(&str, &str) -> Result<(), String>,
    ) -> Result<TempDir, String> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let dir =
            std::env::temp_dir().join(format!("kvxfer-bench-tls-{}-{role}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let guard = TempDir(dir.clone());
        let (cert, key) = if role == "prefill" {
            &self.prefill
        } else {
            &self.decode
        };
        for (file, text, config_key) in [
            ("ca.pem", &self.ca, "tls_ca_file"),
            ("engine.pem", cert, "tls_cert_file"),
            ("engine.key", key, "tls_key_file"),
        ] {
            let path = dir.join(file);
            std::fs::write(&path, text)
                .and_then(|()| {
                    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                })
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            set(
                config_key,
                path.to_str().ok_or("a temporary path is not UTF-8")?,
            )?;
        }
        Ok(guard)
    }
}

/// A directory removed on drop.
pub struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
