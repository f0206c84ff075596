//! The docs agree with the code: `docs/spec.md` defines every rule id the repository cites.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const PREFIXES: [&str; 8] = ["CLI", "HTTP", "ID", "LC", "RS", "RD", "DU", "IN"];

/// Every rule id (`LC-7`, `ID-3a`, ...) in `text`, as whole words.
fn rule_ids(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    for (i, _) in text.char_indices() {
        if i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_') {
            continue;
        }
        for prefix in PREFIXES {
            let rest = &bytes[i..];
            if !rest.starts_with(prefix.as_bytes()) || rest.get(prefix.len()) != Some(&b'-') {
                continue;
            }
            let mut end = prefix.len() + 1;
            while rest.get(end).is_some_and(u8::is_ascii_digit) {
                end += 1;
            }
            if end == prefix.len() + 1 {
                continue;
            }
            if rest.get(end).is_some_and(u8::is_ascii_lowercase) {
                end += 1;
            }
            if rest
                .get(end)
                .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
            {
                continue;
            }
            out.push(text[i..i + end].to_string());
        }
    }
    out
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if !path.ends_with("node_modules") {
                files_under(&path, out);
            }
        } else if path.extension().is_some_and(|e| {
            ["rs", "md", "py", "mjs", "sql", "json", "toml"].contains(&e.to_str().unwrap_or(""))
        }) {
            out.push(path);
        }
    }
}

#[test]
fn docs_spec_defines_every_rule_id_the_repository_cites_once() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let spec = std::fs::read_to_string(root.join("docs/spec.md")).expect("docs/spec.md exists");
    // A definition is a list item that starts with the id in bold: `- **LC-7** ...`.
    let mut defined: BTreeMap<String, usize> = BTreeMap::new();
    for line in spec.lines() {
        if let Some(rest) = line.strip_prefix("- **")
            && let Some((id, _)) = rest.split_once("**")
            && rule_ids(id) == [id]
        {
            *defined.entry(id.to_string()).or_default() += 1;
        }
    }
    let twice: Vec<_> = defined.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "defined more than once: {twice:?}");

    let mut files = vec![root.join("README.md")];
    for dir in ["src", "tests", "docs", "benches"] {
        files_under(&root.join(dir), &mut files);
    }
    let mut undefined: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for id in rule_ids(&text) {
            if !defined.contains_key(&id) {
                let shown = file
                    .strip_prefix(root)
                    .unwrap_or(file)
                    .display()
                    .to_string();
                undefined.entry(id).or_default().insert(shown);
            }
        }
    }
    assert!(
        undefined.is_empty(),
        "rule ids cited but not defined in docs/spec.md: {undefined:?}"
    );
    assert!(
        defined.len() >= 50,
        "the contract defines its rules: {defined:?}"
    );
}

#[test]
fn rule_ids_are_found_as_whole_words_only() {
    assert_eq!(
        rule_ids("LC-7, ID-3a and (RD-6); not XID-3, LC-, ID-3ab or ID-12x9"),
        ["LC-7", "ID-3a", "RD-6"]
    );
}

/// The keys `docs/configuration.md` documents, as dotted paths (`workers.lease_secs`,
/// `backends.name`): the first column of each table under the key sections.
fn documented_config_keys(doc: &str) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut section: Option<String> = None;
    for line in doc.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            let heading = heading.trim_matches('`');
            section = if heading == "Top-level keys" {
                Some(String::new())
            } else if heading.starts_with('[') {
                Some(format!(
                    "{}.",
                    heading.trim_matches(|c| c == '[' || c == ']')
                ))
            } else {
                None
            };
            continue;
        }
        let Some(prefix) = &section else { continue };
        if let Some(rest) = line.strip_prefix("| `")
            && let Some((key, _)) = rest.split_once('`')
        {
            keys.insert(format!("{prefix}{key}"));
        }
    }
    keys
}

/// The keys the code accepts, from the config struct itself.
fn config_keys() -> BTreeSet<String> {
    use holdfast::config::{Backend, Config, ModelRewrite, Namespace, Passthrough, Price};
    let config = Config {
        backends: vec![Backend {
            name: "b".into(),
            kind: holdfast::provider::Provider::Openai,
            base_url: "http://x/v1".into(),
            api_key_env: None,
        }],
        model_rewrites: vec![ModelRewrite {
            pattern: "m".into(),
            backend: "b".into(),
            model: None,
        }],
        namespaces: vec![Namespace {
            name: "n".into(),
            api_keys: vec!["k".into()],
        }],
        passthrough: vec![Passthrough {
            path: "/v1/moderations".into(),
            backend: "b".into(),
        }],
        prices: vec![Price {
            backend: "b".into(),
            model: "m".into(),
            input_per_mtok: 1.0,
            output_per_mtok: 1.0,
            cached_input_per_mtok: None,
            cache_write_per_mtok: None,
        }],
        ..Config::default()
    };
    let mut keys = BTreeSet::new();
    let serde_json::Value::Object(top) = serde_json::to_value(&config).unwrap() else {
        panic!("config serialises to an object")
    };
    for (key, value) in top {
        let nested = match &value {
            serde_json::Value::Object(table) => Some(table.clone()),
            serde_json::Value::Array(items) => items.first().and_then(|v| v.as_object().cloned()),
            _ => None,
        };
        if let Some(table) = nested {
            keys.extend(table.keys().map(|k| format!("{key}.{k}")));
        }
        keys.insert(key);
    }
    keys
}

#[test]
fn docs_configuration_lists_exactly_the_keys_the_code_accepts() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/configuration.md")).unwrap();
    let documented = documented_config_keys(&doc);
    let code = config_keys();
    let undocumented: Vec<_> = code.difference(&documented).collect();
    let unknown: Vec<_> = documented.difference(&code).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "keys the code accepts but docs/configuration.md does not list: {undocumented:?}; \
         keys it lists that the code does not know: {unknown:?}"
    );
}

/// The `| module | uses |` table of `src/lib.rs`: each module and the modules it may use.
fn dependency_table(lib: &str) -> BTreeMap<String, BTreeSet<String>> {
    let names = |cell: &str| -> BTreeSet<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };
    lib.lines()
        .filter_map(|l| l.strip_prefix("//! | `"))
        .filter_map(|row| {
            let (module, rest) = row.split_once('`')?;
            let uses = rest.trim_start_matches(' ').strip_prefix('|')?;
            Some((module.to_string(), names(uses)))
        })
        .collect()
}

/// The crate modules a module's source names as `crate::NAME`.
fn used_modules(root: &Path, module: &str) -> BTreeSet<String> {
    let mut files = Vec::new();
    let dir = root.join("src").join(module);
    if dir.is_dir() {
        files_under(&dir, &mut files);
    }
    let file = root.join("src").join(format!("{module}.rs"));
    if file.is_file() {
        files.push(file);
    }
    let mut used = BTreeSet::new();
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "rs"))
    {
        let text = std::fs::read_to_string(file).unwrap();
        for (i, _) in text.match_indices("crate::") {
            if i > 0 && text.as_bytes()[i - 1].is_ascii_alphanumeric() {
                continue; // `holdfast_crate::` and the like
            }
            let name: String = text[i + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !name.is_empty() && name != module {
                used.insert(name);
            }
        }
    }
    used
}

#[test]
fn modules_use_only_what_the_dependency_rule_in_lib_rs_allows_and_it_has_no_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let table = dependency_table(&lib);
    // Every module declared in lib.rs has a row.
    let declared: BTreeSet<String> = lib
        .lines()
        .filter_map(|l| {
            let l = l.trim_start_matches("pub ");
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect();
    let rows: BTreeSet<String> = table.keys().cloned().collect();
    assert_eq!(
        declared, rows,
        "src/lib.rs: the dependency table's rows are not the modules"
    );
    let mut violations = Vec::new();
    for (module, allowed) in &table {
        for used in used_modules(root, module) {
            if !allowed.contains(&used) {
                violations.push(format!("{module} uses {used}"));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "not allowed by src/lib.rs's dependency table: {violations:?}"
    );
    // No cycle: repeatedly remove modules that use nothing left.
    let mut left = table.clone();
    while let Some(leaf) = left
        .iter()
        .find(|(_, uses)| uses.iter().all(|u| !left.contains_key(u)))
        .map(|(m, _)| m.clone())
    {
        left.remove(&leaf);
    }
    assert!(
        left.is_empty(),
        "the dependency table has a cycle among {left:?}"
    );
    // The rules issue 12 names.
    for (module, never) in [
        ("store", "hub"),
        ("store", "worker"),
        ("hub", "http"),
        ("hub", "worker"),
    ] {
        assert!(
            !table[module].contains(never),
            "{module} must not use {never}"
        );
    }
}

#[test]
fn the_dependency_check_sees_a_use_the_table_does_not_allow() {
    let table = dependency_table("//! | `store` | `config` |\n//! | `config` | |\n");
    assert_eq!(table["store"], BTreeSet::from(["config".to_string()]));
    assert!(table["config"].is_empty());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The real store uses `provider`, which this table does not allow.
    assert!(used_modules(root, "store").contains("provider"));
}
