//! Certificates for the TLS tests: a CA per cluster, and engine certificates it signs,
//! written as PEM files that the engines' `tls_*` keys name.

use std::os::unix::fs::PermissionsExt;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// A CA and the directory its files go to, deleted on drop.
pub struct Pki {
    dir: std::path::PathBuf,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
    pub ca_file: String,
}

impl Pki {
    /// A new CA named `name` (files under a directory of this process and `name`).
    pub fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("kvxfer-pki-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("kvxfer test CA {name}"));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = params.self_signed(&ca_key).unwrap();
        let ca_file = dir.join("ca.pem").to_str().unwrap().to_string();
        std::fs::write(&ca_file, ca.pem()).unwrap();
        Pki {
            dir,
            ca,
            ca_key,
            ca_file,
        }
    }

    /// Writes a certificate for engine `name`, signed by this CA, and its key; returns
    /// the paths (certificate, key).
    pub fn issue(&self, name: &str) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["kvxfer".to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let cert_file = self.dir.join(format!("{name}.pem"));
        let key_file = self.dir.join(format!("{name}.key"));
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        // A private key must be readable by its owner only, or the engine refuses it.
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        (
            cert_file.to_str().unwrap().to_string(),
            key_file.to_str().unwrap().to_string(),
        )
    }

    /// The three `tls_*` config keys of engine `name` of this CA's cluster.
    pub fn keys(&self, name: &str) -> Vec<(String, String)> {
        let (cert, key) = self.issue(name);
        vec![
            ("tls_cert_file".into(), cert),
            ("tls_key_file".into(), key),
            ("tls_ca_file".into(), self.ca_file.clone()),
        ]
    }

    /// A path inside this CA's directory.
    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `kv` as the `&str` pairs the config helpers take.
pub fn refs(kv: &[(String, String)]) -> Vec<(&str, &str)> {
    kv.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}
