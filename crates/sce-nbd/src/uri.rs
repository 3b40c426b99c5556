//! `NbdUri`: where an NBD export is (`nbd://host:port/name`, `nbd+unix:///name?socket=PATH`).

use std::path::PathBuf;

/// Where an export is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdUri {
    /// `nbd://host[:port]/name`.
    Tcp {
        /// `host:port`.
        addr: String,
        /// Export name.
        name: String,
    },
    /// `nbd+unix:///name?socket=PATH`.
    Unix {
        /// Socket path.
        socket: PathBuf,
        /// Export name.
        name: String,
    },
}

impl std::str::FromStr for NbdUri {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("nbd+unix://") {
            let (path, query) = rest
                .split_once('?')
                .ok_or_else(|| format!("{s}: nbd+unix URIs need ?socket=PATH"))?;
            let name = path.strip_prefix('/').unwrap_or(path).to_string();
            let socket = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .filter(|p| !p.is_empty())
                .ok_or_else(|| format!("{s}: nbd+unix URIs need ?socket=PATH"))?;
            Ok(NbdUri::Unix {
                socket: PathBuf::from(socket),
                name,
            })
        } else if let Some(rest) = s.strip_prefix("nbd://") {
            let (hostport, name) = rest.split_once('/').unwrap_or((rest, ""));
            if hostport.is_empty() {
                return Err(format!("{s}: nbd URIs need a host"));
            }
            let addr = if hostport.contains(':') {
                hostport.to_string()
            } else {
                format!("{hostport}:10809")
            };
            Ok(NbdUri::Tcp {
                addr,
                name: name.to_string(),
            })
        } else {
            Err(format!(
                "{s:?} is not an NBD URI (nbd://host:port/name or nbd+unix:///name?socket=PATH)"
            ))
        }
    }
}

impl std::fmt::Display for NbdUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NbdUri::Tcp { addr, name } => write!(f, "nbd://{addr}/{name}"),
            NbdUri::Unix { socket, name } => {
                write!(f, "nbd+unix:///{name}?socket={}", socket.display())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        assert_eq!(
            "nbd://127.0.0.1:10810/lun0".parse(),
            Ok(NbdUri::Tcp {
                addr: "127.0.0.1:10810".into(),
                name: "lun0".into()
            })
        );
        assert_eq!(
            "nbd://filer".parse(),
            Ok(NbdUri::Tcp {
                addr: "filer:10809".into(),
                name: String::new()
            })
        );
        assert_eq!(
            "nbd+unix:///vol?socket=/run/x.sock".parse(),
            Ok(NbdUri::Unix {
                socket: "/run/x.sock".into(),
                name: "vol".into()
            })
        );
        assert!("nbd+unix:///vol".parse::<NbdUri>().is_err());
        assert!("http://x".parse::<NbdUri>().is_err());
        assert!("nbd:///x".parse::<NbdUri>().is_err());
    }
}
