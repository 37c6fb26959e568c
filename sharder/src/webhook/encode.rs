//! The webhook's answer written straight into bytes: the JSON patch that labels an object and the
//! `AdmissionReview` around it, each into one vector sized up front, without a JSON tree first.
//!
//! Strings are escaped as `serde_json` escapes them, and label keys as JSON pointer segments
//! (RFC 6901), so the bytes read back as the same JSON a serializer would have written.

/// Path of an object's labels map in a JSON patch.
const LABELS: &str = "/metadata/labels";

/// The operation that adds an empty labels map.
const CREATE_LABELS: &[u8] = br#"{"op":"add","path":"/metadata/labels","value":{}},"#;

/// Room for a [`label_patch`]: enough unless its strings need more escapes than pointer
/// segments of label keys do (then the vector grows once).
fn patch_capacity(label: &str, value: &str, remove: Option<&str>) -> usize {
    // The operations' fixed parts, with room to spare.
    const OPERATION: usize = 48;
    let path = |key: &str| LABELS.len() + 3 + key.len() + key.len() / 2;
    CREATE_LABELS.len()
        + OPERATION
        + path(label)
        + value.len()
        + remove.map_or(0, |r| OPERATION + path(r))
}

/// A JSON patch (RFC 6902) that sets label `label` to `value`, adding the labels map first when
/// the object has none (`create_labels`), and removes label `remove`, if any.
pub(super) fn label_patch(
    label: &str,
    value: &str,
    create_labels: bool,
    remove: Option<&str>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(patch_capacity(label, value, remove));
    out.push(b'[');
    if create_labels {
        out.extend_from_slice(CREATE_LABELS);
    }
    out.extend_from_slice(br#"{"op":"add","path":"#);
    push_label_path(&mut out, label);
    out.extend_from_slice(br#","value":"#);
    push_string(&mut out, value);
    out.push(b'}');
    if let Some(remove) = remove {
        out.extend_from_slice(br#",{"op":"remove","path":"#);
        push_label_path(&mut out, remove);
        out.push(b'}');
    }
    out.push(b']');
    out
}

/// The body of an `admission.k8s.io/v1` `AdmissionReview` that answers request `uid` by allowing
/// it, with `patch` (the patch's JSON, sent base64-encoded) if given.
pub(super) fn allowed_review(uid: &str, patch: Option<&[u8]>, warnings: &[String]) -> Vec<u8> {
    let warnings_len: usize = warnings.iter().map(|w| w.len() + 3).sum();
    let mut out = Vec::with_capacity(review_capacity(uid, patch) + warnings_len);
    out.extend_from_slice(REVIEW_HEAD);
    push_string(&mut out, uid);
    out.extend_from_slice(ALLOWED);
    if let Some(patch) = patch {
        out.extend_from_slice(PATCH_HEAD);
        push_base64(&mut out, patch);
        out.push(b'"');
    }
    if !warnings.is_empty() {
        // Shown by kubectl and client-go to whoever wrote the object.
        out.extend_from_slice(br#","warnings":["#);
        for (i, warning) in warnings.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            push_string(&mut out, warning);
        }
        out.push(b']');
    }
    out.extend_from_slice(b"}}");
    out
}

const REVIEW_HEAD: &[u8] =
    br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"#;
const ALLOWED: &[u8] = br#","allowed":true"#;
const PATCH_HEAD: &[u8] = br#","patchType":"JSONPatch","patch":""#;

/// Room for an [`allowed_review`]: enough unless the uid needs escapes (uids are UUIDs).
fn review_capacity(uid: &str, patch: Option<&[u8]>) -> usize {
    let patch = patch.map_or(0, |p| PATCH_HEAD.len() + base64_len(p.len()) + 1);
    REVIEW_HEAD.len() + uid.len() + 2 + ALLOWED.len() + patch + 2
}

/// Appends the JSON string of the path of label `label`: the labels map's path and the key as
/// one pointer segment, `~` written `~0` and `/` written `~1`.
fn push_label_path(out: &mut Vec<u8>, label: &str) {
    out.push(b'"');
    out.extend_from_slice(LABELS.as_bytes());
    out.push(b'/');
    push_pointer_segment(out, label);
    out.push(b'"');
}

/// Appends `segment` escaped as a JSON pointer segment (RFC 6901) inside a JSON string.
pub(super) fn push_pointer_segment(out: &mut Vec<u8>, segment: &str) {
    for (i, part) in segment.split('/').enumerate() {
        if i > 0 {
            out.extend_from_slice(b"~1");
        }
        for (j, piece) in part.split('~').enumerate() {
            if j > 0 {
                out.extend_from_slice(b"~0");
            }
            push_string_contents(out, piece);
        }
    }
}

/// Appends `text` as a JSON string.
fn push_string(out: &mut Vec<u8>, text: &str) {
    out.push(b'"');
    push_string_contents(out, text);
    out.push(b'"');
}

/// Appends `text` as the inside of a JSON string: quotes, backslashes and control characters
/// escaped the way `serde_json` writes them, everything else as it is.
fn push_string_contents(out: &mut Vec<u8>, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = text.as_bytes();
    let mut start = 0;
    for (i, &byte) in bytes.iter().enumerate() {
        let short = match byte {
            b'"' => b'"',
            b'\\' => b'\\',
            b'\n' => b'n',
            b'\r' => b'r',
            b'\t' => b't',
            0x08 => b'b',
            0x0c => b'f',
            0x00..=0x1f => 0,
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        start = i + 1;
        if short == 0 {
            let (high, low) = (HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 0xf)]);
            out.extend_from_slice(&[b'\\', b'u', b'0', b'0', high, low]);
        } else {
            out.extend_from_slice(&[b'\\', short]);
        }
    }
    out.extend_from_slice(&bytes[start..]);
}

/// Length of `len` bytes in padded base64.
fn base64_len(len: usize) -> usize {
    len.div_ceil(3) * 4
}

/// Appends `data` in base64 with the standard alphabet and padding, as `[]byte` fields are
/// written in Kubernetes JSON.
fn push_base64(out: &mut Vec<u8>, data: &[u8]) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let digit = |group: u32, shift: u32| ALPHABET[((group >> shift) & 0x3f) as usize];
    out.reserve(base64_len(data.len()));
    let mut chunks = data.chunks_exact(3);
    for chunk in &mut chunks {
        let group = u32::from(chunk[0]) << 16 | u32::from(chunk[1]) << 8 | u32::from(chunk[2]);
        out.extend_from_slice(&[
            digit(group, 18),
            digit(group, 12),
            digit(group, 6),
            digit(group, 0),
        ]);
    }
    match *chunks.remainder() {
        [a] => {
            let group = u32::from(a) << 16;
            out.extend_from_slice(&[digit(group, 18), digit(group, 12), b'=', b'=']);
        }
        [a, b] => {
            let group = u32::from(a) << 16 | u32::from(b) << 8;
            out.extend_from_slice(&[digit(group, 18), digit(group, 12), digit(group, 6), b'=']);
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests;
