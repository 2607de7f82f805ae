//! Reading configuration keys out of the code and out of the READMEs, for the tests in `tests/` that
//! keep the two in step: a key the code accepts but no README names is an operator's surprise, and a
//! key a README names but the code refuses is a broken deployment.

/// The keys a `#[serde(deny_unknown_fields)]` configuration accepts, read from its refusal of an
/// unknown key (serde lists every field it expected: "unknown field `x`, expected one of `a`, `b`").
/// Panics when the message lists none, so a changed message fails the test rather than passing it.
pub fn keys_in_refusal(refusal: &str) -> Vec<String> {
    let listed = refusal
        .split_once("expected")
        .unwrap_or_else(|| panic!("no list of expected keys in the refusal: {refusal}"))
        .1;
    let keys = backticked(listed);
    assert!(!keys.is_empty(), "no key listed in the refusal: {refusal}");
    keys
}

/// Every `name` written between backticks in `text`, in order.
pub fn backticked(text: &str) -> Vec<String> {
    text.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// `section.key` for every key of every section of a TOML document (top-level arrays and empty
/// sections, which hold no key of their own, are left out).
pub fn dotted_keys(document: &str) -> Vec<(String, String)> {
    let table: toml::Table = document.parse().expect("a TOML document");
    let mut keys = Vec::new();
    for (section, value) in &table {
        if let toml::Value::Table(inner) = value {
            for key in inner.keys() {
                if !matches!(&inner[key], toml::Value::Table(t) if t.is_empty()) {
                    keys.push((section.clone(), key.clone()));
                }
            }
        }
    }
    keys
}

/// The first cells of a Markdown table's rows whose first cell starts with a backticked name: the
/// keys a configuration table lists.
pub fn table_keys(markdown: &str) -> Vec<String> {
    markdown
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split(" |").next())
        .flat_map(|cell| backticked(&format!("`{cell}")))
        .collect()
}

/// The dotted keys a patterned row of a configuration table stands for: `a.{b,c}_d` is `a.b_d` and
/// `a.c_d`; `[[t]] x, y` is `t.x` and `t.y`; a plain key is itself.
pub fn expand_key_pattern(pattern: &str) -> Vec<String> {
    if let Some(rest) = pattern.strip_prefix("[[") {
        let (table, fields) = rest.split_once("]]").unwrap_or_else(|| panic!("no ]] in {pattern:?}"));
        return fields.split(',').map(|f| format!("{table}.{}", f.trim())).collect();
    }
    match (pattern.split_once('{'), pattern.split_once('}')) {
        (Some((head, _)), Some((inside, tail))) => {
            let choices = &inside[head.len() + 1..];
            choices.split(',').map(|c| format!("{head}{}{tail}", c.trim())).collect()
        }
        _ => vec![pattern.to_string()],
    }
}

/// The part of `markdown` from the first `## ` heading that starts with `heading` up to the next `## `
/// heading. Panics when there is no such heading, so a renamed section fails the test.
pub fn section<'a>(markdown: &'a str, heading: &str) -> &'a str {
    let start = markdown
        .match_indices("## ")
        .map(|(i, _)| i)
        .find(|&i| (i == 0 || markdown.as_bytes()[i - 1] == b'\n') && markdown[i..].starts_with(heading))
        .unwrap_or_else(|| panic!("no section starting with {heading:?}"));
    let body = &markdown[start + heading.len()..];
    let end = body.find("\n## ").map_or(body.len(), |i| i + 1);
    &markdown[start..start + heading.len() + end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_keys_serde_lists_in_a_refusal() {
        let refusal = "unknown field `zzz`, expected one of `workers`, `chunk_bytes`";
        assert_eq!(keys_in_refusal(refusal), ["workers", "chunk_bytes"]);
        assert_eq!(keys_in_refusal("unknown field `zzz`, expected `only`"), ["only"]);
    }

    #[test]
    #[should_panic(expected = "no list of expected keys")]
    fn a_refusal_without_a_list_fails() {
        keys_in_refusal("invalid type: found a string");
    }

    #[test]
    #[should_panic(expected = "no key listed")]
    fn a_list_without_keys_fails() {
        keys_in_refusal("invalid type: string, expected an integer");
    }

    #[test]
    fn dotted_keys_skip_arrays_and_empty_sections() {
        let keys = dotted_keys("peers = []\n[a]\nx = 1\n[b]\n[b.c]\n[d]\ny = [1]\n");
        assert_eq!(keys, [("a".into(), "x".into()), ("d".into(), "y".into())]);
    }

    #[test]
    fn a_section_runs_to_the_next_heading_of_its_level() {
        let text = "# T\n## Modules\nm\n## Config (TOML)\n| `a` |\n### Sub\ns\n## Metrics\nx\n";
        assert_eq!(section(text, "## Conf"), "## Config (TOML)\n| `a` |\n### Sub\ns\n");
        assert_eq!(section(text, "## Metrics"), "## Metrics\nx\n");
    }

    #[test]
    #[should_panic(expected = "no section starting with")]
    fn a_missing_section_fails() {
        section("## Modules\n", "## Conf");
    }

    #[test]
    fn patterned_rows_expand_to_their_keys() {
        assert_eq!(
            expand_key_pattern("peer_link.tls.{cert,key,ca}_file"),
            ["peer_link.tls.cert_file", "peer_link.tls.key_file", "peer_link.tls.ca_file"]
        );
        assert_eq!(expand_key_pattern("d.tls.{ca_file,cert_file}"), ["d.tls.ca_file", "d.tls.cert_file"]);
        assert_eq!(expand_key_pattern("[[peers]] name, address"), ["peers.name", "peers.address"]);
        assert_eq!(expand_key_pattern("gateway.name"), ["gateway.name"]);
    }

    #[test]
    fn table_keys_take_every_backticked_name_of_the_first_cell() {
        let table = "| key | default |\n|---|---|\n| `a` | 1 |\n| `b`, `c` | `d` |\nprose `e`\n";
        assert_eq!(table_keys(table), ["a", "b", "c"]);
    }
}
