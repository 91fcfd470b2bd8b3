//! Every relative link of the repository's Markdown files points to a file that exists, and
//! every `#anchor` to a heading of its target, by GitHub's slug rules. Pure: no network,
//! no root; external links (`http:`, `https:`, `mailto:`) are not checked.

use std::collections::HashMap;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// One link found in a Markdown file: the line it is on and its destination.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Link {
    line: usize,
    dest: String,
}

/// Lines outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut fence: Option<(char, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let marker = t.chars().next().filter(|c| *c == '`' || *c == '~');
        if let Some(c) = marker {
            let n = t.chars().take_while(|x| *x == c).count();
            if n >= 3 {
                match fence {
                    None => {
                        fence = Some((c, n));
                        continue;
                    }
                    Some((fc, fnum)) if fc == c && n >= fnum && t[n..].trim().is_empty() => {
                        fence = None;
                        continue;
                    }
                    _ => {}
                }
            }
        }
        if fence.is_none() {
            out.push((i + 1, line));
        }
    }
    out
}

/// The line without its inline code spans (links inside them are not links).
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        out.push_str(&rest[..start]);
        let ticks = rest[start..].chars().take_while(|c| *c == '`').count();
        let after = &rest[start + ticks..];
        let close = "`".repeat(ticks);
        match after.find(&close) {
            Some(end) => rest = &after[end + ticks..],
            None => {
                out.push_str(&rest[start..]);
                return out;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Inline links `[text](dest)` / `![alt](dest)` and reference definitions `[x]: dest`.
fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    for (n, raw) in prose_lines(text) {
        let line = without_code_spans(raw);
        let t = line.trim_start();
        if t.starts_with('[') {
            if let Some(end) = t.find("]:") {
                let dest = t[end + 2..].split_whitespace().next().unwrap_or("");
                if !dest.is_empty() && !t[..end].contains('(') {
                    out.push(Link {
                        line: n,
                        dest: dest.trim_matches(|c| c == '<' || c == '>').to_string(),
                    });
                    continue;
                }
            }
        }
        let bytes = line.as_bytes();
        let mut i = 0;
        while let Some(p) = line[i..].find("](") {
            let start = i + p + 2;
            let mut depth = 0usize;
            let mut end = None;
            for (j, &b) in bytes.iter().enumerate().skip(start) {
                match b {
                    b'(' => depth += 1,
                    b')' if depth == 0 => {
                        end = Some(j);
                        break;
                    }
                    b')' => depth -= 1,
                    _ => {}
                }
            }
            let Some(end) = end else { break };
            let inner = line[start..end].trim();
            // `[text](dest "title")`: the destination is the first word.
            let dest = inner.split_whitespace().next().unwrap_or("");
            let dest = dest.trim_matches(|c| c == '<' || c == '>');
            if !dest.is_empty() {
                out.push(Link {
                    line: n,
                    dest: dest.to_string(),
                });
            }
            i = end + 1;
        }
    }
    out
}

/// GitHub's anchor for a heading's text: the text as rendered (link targets, emphasis and
/// code markers dropped), lower-cased, every character that is not a letter, a digit, a
/// space, `-` or `_` removed, spaces turned into `-`.
fn slug(heading: &str) -> String {
    // `[text](url)` renders as `text`.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        match (rest[open..].find("]("), rest[open..].find(')')) {
            (Some(mid), Some(close)) if mid < close => {
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..open + mid]);
                rest = &rest[open + close + 1..];
            }
            _ => {
                text.push_str(&rest[..=open]);
                rest = &rest[open + 1..];
            }
        }
    }
    text.push_str(rest);
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors a Markdown file's ATX headings get (duplicates numbered `-1`, `-2`, ...).
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (_, line) in prose_lines(text) {
        let t = line.trim_start();
        if line.len() - t.len() > 3 {
            continue;
        }
        let level = t.chars().take_while(|c| *c == '#').count();
        if level == 0 || level > 6 {
            continue;
        }
        let rest = &t[level..];
        if !(rest.is_empty() || rest.starts_with(' ') || rest.starts_with('\t')) {
            continue;
        }
        let mut title = rest.trim();
        // A closing sequence of `#`s is not part of the heading.
        let stripped = title.trim_end_matches('#');
        if stripped.is_empty() || stripped.ends_with(' ') {
            title = stripped.trim_end();
        }
        let base = slug(title);
        let n = seen.entry(base.clone()).or_insert(0);
        out.push(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// `%20` and the like in a link's path.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `a/./b/../c` → `a/c`, without touching the filesystem.
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// What is wrong with the links of `file` (a Markdown file under `root`), one message per
/// broken link. `read` gives a Markdown file's text, `exists` whether a path exists.
fn check_file(
    root: &Path,
    file: &Path,
    text: &str,
    read: &dyn Fn(&Path) -> Option<String>,
    exists: &dyn Fn(&Path) -> bool,
) -> Vec<String> {
    let mut errors = Vec::new();
    let rel = file
        .strip_prefix(root)
        .unwrap_or(file)
        .display()
        .to_string();
    for link in links(text) {
        let d = link.dest.as_str();
        let lower = d.to_ascii_lowercase();
        if lower.starts_with("http://")
            || lower.starts_with("https://")
            || lower.starts_with("mailto:")
            || lower.starts_with("ftp://")
        {
            continue;
        }
        let (path, anchor) = match d.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (d, None),
        };
        let path = path.split('?').next().unwrap_or("");
        let target = if path.is_empty() {
            file.to_path_buf()
        } else if let Some(abs) = path.strip_prefix('/') {
            normalize(&root.join(percent_decode(abs)))
        } else {
            normalize(&file.parent().unwrap_or(root).join(percent_decode(path)))
        };
        if !target.starts_with(root) {
            errors.push(format!(
                "{rel}:{}: link `{d}` leaves the repository",
                link.line
            ));
            continue;
        }
        if target != file && !exists(&target) {
            errors.push(format!(
                "{rel}:{}: link `{d}`: {} does not exist",
                link.line,
                target.strip_prefix(root).unwrap_or(&target).display()
            ));
            continue;
        }
        let Some(anchor) = anchor.filter(|a| !a.is_empty()) else {
            continue;
        };
        if target.extension().and_then(|e| e.to_str()) != Some("md") {
            // Line anchors of source files (`#L10`) are GitHub's, not the file's.
            continue;
        }
        let target_text = if target == file {
            Some(text.to_string())
        } else {
            read(&target)
        };
        let Some(target_text) = target_text else {
            errors.push(format!(
                "{rel}:{}: link `{d}`: cannot read its target",
                link.line
            ));
            continue;
        };
        let wanted = percent_decode(anchor).to_lowercase();
        if !anchors(&target_text).contains(&wanted) {
            errors.push(format!(
                "{rel}:{}: link `{d}`: no heading of {} has the anchor #{wanted}",
                link.line,
                target.strip_prefix(root).unwrap_or(&target).display()
            ));
        }
    }
    errors
}

/// The Markdown files of the repository: every `*.md` outside hidden directories, build
/// output and the fuzzers' generated seeds.
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with('.') || name == "target" || name == "seeds" {
            continue;
        }
        if p.is_dir() {
            markdown_files(&p, out);
        } else if name.ends_with(".md") {
            out.push(p);
        }
    }
}

#[test]
fn every_relative_link_and_anchor_of_the_markdown_files_resolves() {
    let root = juneau_tests::repo_root();
    let mut files = Vec::new();
    markdown_files(&root, &mut files);
    assert!(
        files.iter().any(|f| f.ends_with("docs/architecture.md")),
        "no Markdown found under {}",
        root.display()
    );
    let read = |p: &Path| fs::read_to_string(p).ok();
    let exists = |p: &Path| p.exists();
    let mut errors = Vec::new();
    let mut checked = 0;
    for f in &files {
        let text = fs::read_to_string(f).expect("read a Markdown file");
        checked += links(&text).len();
        errors.extend(check_file(&root, f, &text, &read, &exists));
    }
    assert!(
        errors.is_empty(),
        "{} broken link(s) in {} files ({checked} links checked):\n{}",
        errors.len(),
        files.len(),
        errors.join("\n")
    );
}

#[cfg(test)]
mod unit {
    use super::*;

    fn fixture() -> (PathBuf, HashMap<PathBuf, String>) {
        let root = PathBuf::from("/repo");
        let mut files = HashMap::new();
        files.insert(
            root.join("docs/a.md"),
            "# Title\n\n## Redirects between nodes\n\n## What `--flag` does (opt-in)\n\n\
             ## Dup\n\n## Dup\n\n```text\n## not a heading\n```\n"
                .to_string(),
        );
        files.insert(root.join("README.md"), "# Readme\n".to_string());
        files.insert(root.join("dataplane/src/fast.rs"), String::new());
        (root, files)
    }

    fn check(text: &str) -> Vec<String> {
        let (root, files) = fixture();
        let read = |p: &Path| files.get(p).cloned();
        let exists = |p: &Path| files.contains_key(p) || p == root.join("docs");
        check_file(&root, &root.join("docs/b.md"), text, &read, &exists)
    }

    #[test]
    fn github_slugs() {
        assert_eq!(slug("Redirects between nodes"), "redirects-between-nodes");
        assert_eq!(
            slug("What `--flag` does (opt-in)"),
            "what---flag-does-opt-in"
        );
        assert_eq!(slug("Flow table: shared"), "flow-table-shared");
        assert_eq!(slug("See [the page](x.md) now"), "see-the-page-now");
        assert_eq!(slug("snake_case and Ünïcode"), "snake_case-and-ünïcode");
        let a = anchors(&fixture().1[&PathBuf::from("/repo/docs/a.md")]);
        assert_eq!(
            a,
            [
                "title",
                "redirects-between-nodes",
                "what---flag-does-opt-in",
                "dup",
                "dup-1"
            ]
        );
    }

    #[test]
    fn good_links_pass() {
        let text = "See [a](a.md), [b](a.md#redirects-between-nodes), [c](#local), \
                    [d](../README.md#readme), [e](a.md#dup-1), [f](https://example.com/x#y), \
                    [g](../dataplane/src/fast.rs), [h](a.md#what---flag-does-opt-in \"t\").\n\
                    `[not](a link.md)`\n\n## Local\n\n```\n[x](missing.md)\n```\n\
                    [ref]: ../README.md\n";
        assert_eq!(check(text), Vec::<String>::new());
    }

    #[test]
    fn a_missing_file_fails() {
        let e = check("a [broken](missing.md) link\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].contains("docs/b.md:1") && e[0].contains("does not exist"),
            "{e:?}"
        );
        let e = check("[ref]: ../nowhere.md\n");
        assert_eq!(e.len(), 1, "{e:?}");
    }

    #[test]
    fn a_missing_anchor_fails() {
        let e = check("x\n[old](a.md#redirects-between-nodes-issue-12)\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].contains("docs/b.md:2") && e[0].contains("#redirects-between-nodes-issue-12"));
        assert_eq!(check("[self](#nowhere)\n").len(), 1);
        assert_eq!(check("[heading in code](a.md#not-a-heading)\n").len(), 1);
    }

    #[test]
    fn a_link_out_of_the_repository_fails() {
        assert_eq!(check("[up](../../etc/passwd)\n").len(), 1);
    }
}
