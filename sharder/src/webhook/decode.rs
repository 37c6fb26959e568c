//! The part of an `AdmissionReview` the webhook's decision reads, decoded without building the
//! rest.
//!
//! Strings borrow from the request body unless JSON escapes force a copy; everything else (the
//! object's data and managed fields, user info, the old object, options) is skipped by the parser
//! without being built. So a review costs the same few allocations however large its object is:
//! at most the labels' list and a copy of each escaped string.
//!
//! Each field keeps the rules of the owned types this replaces: `null` is an absent optional
//! field, a field of the wrong type is an error, a label given twice counts with its last value,
//! and an owner reference reads like `k8s_openapi`'s (missing strings empty, a repeated field's
//! last value wins).

use std::borrow::Cow;
use std::fmt;
use std::ops::Deref;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The review: its type and the request, if any.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Review<'a> {
    #[serde(borrow)]
    pub(super) api_version: Text<'a>,
    #[serde(borrow)]
    pub(super) kind: Text<'a>,
    #[serde(borrow)]
    pub(super) request: Option<Request<'a>>,
}

/// What the decision and the answer read of an admission request.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Request<'a> {
    #[serde(borrow)]
    pub(super) uid: Text<'a>,
    #[serde(borrow)]
    pub(super) kind: GroupVersionKind<'a>,
    #[serde(borrow)]
    pub(super) resource: GroupVersionResource<'a>,
    #[serde(default, borrow)]
    pub(super) sub_resource: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub(super) namespace: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub(super) object: Option<PartialObject<'a>>,
    #[serde(default)]
    pub(super) dry_run: Option<bool>,
}

/// The request's kind; its version is not read.
#[derive(Debug, Deserialize)]
pub(super) struct GroupVersionKind<'a> {
    #[serde(default, borrow)]
    pub(super) group: Text<'a>,
    #[serde(borrow)]
    pub(super) kind: Text<'a>,
}

/// The request's resource; its version is not read.
#[derive(Debug, Deserialize)]
pub(super) struct GroupVersionResource<'a> {
    #[serde(default, borrow)]
    pub(super) group: Text<'a>,
    #[serde(borrow)]
    pub(super) resource: Text<'a>,
}

/// The object of the request: only its metadata is read.
#[derive(Debug, Deserialize)]
pub(super) struct PartialObject<'a> {
    #[serde(default, borrow)]
    pub(super) metadata: PartialMeta<'a>,
}

/// The metadata fields the decision reads.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PartialMeta<'a> {
    #[serde(default, borrow)]
    pub(super) name: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub(super) namespace: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub(super) labels: Option<Labels<'a>>,
    /// Only the pin annotations (docs/protocol.md §21); the others are checked to be strings and
    /// skipped, so a large `last-applied-configuration` costs nothing.
    #[serde(default, borrow)]
    pub(super) annotations: Option<PinAnnotations<'a>>,
    /// The controller among the owner references; `Some(None)` when there are owner references
    /// but none with `controller: true`.
    #[serde(default, borrow, rename = "ownerReferences")]
    pub(super) controller: Option<Controller<'a>>,
}

/// A JSON string, borrowed from the body when it has no escapes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Text<'a>(Cow<'a, str>);

impl Text<'_> {
    /// The string.
    pub(super) fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for Text<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;

        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Borrowed(v)))
            }

            // The parser unescaped the string into a buffer of its own: copied.
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }

        deserializer.deserialize_str(TextVisitor)
    }
}

/// An object's labels in the order they came. A key given twice counts with its last value, as
/// a map would keep it.
#[derive(Debug, Default)]
pub(super) struct Labels<'a>(Vec<(Text<'a>, Text<'a>)>);

impl Labels<'_> {
    /// The value of label `key`.
    pub(super) fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k.as_str() == key)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the object carries label `key`.
    pub(super) fn contains_key(&self, key: &str) -> bool {
        self.0.iter().any(|(k, _)| k.as_str() == key)
    }

    /// Every key, in the order they came.
    pub(super) fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Labels<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct LabelsVisitor;

        impl<'de> Visitor<'de> for LabelsVisitor {
            type Value = Labels<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of strings")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut labels = Vec::with_capacity(map.size_hint().unwrap_or(0).min(64));
                while let Some(entry) = map.next_entry::<Text<'de>, Text<'de>>()? {
                    labels.push(entry);
                }
                Ok(Labels(labels))
            }
        }

        deserializer.deserialize_map(LabelsVisitor)
    }
}

/// The annotations of an object whose key starts with
/// [`kube_sharding_api::labels::PIN_ANNOTATION_PREFIX`], read like [`Labels`].
#[derive(Debug, Default)]
pub(super) struct PinAnnotations<'a>(Labels<'a>);

impl<'a> Deref for PinAnnotations<'a> {
    type Target = Labels<'a>;

    fn deref(&self) -> &Labels<'a> {
        &self.0
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for PinAnnotations<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PinVisitor;

        impl<'de> Visitor<'de> for PinVisitor {
            type Value = PinAnnotations<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of strings")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut pins = Vec::new();
                while let Some(key) = map.next_key::<Text<'de>>()? {
                    if key.starts_with(kube_sharding_api::labels::PIN_ANNOTATION_PREFIX) {
                        pins.push((key, map.next_value::<Text<'de>>()?));
                    } else {
                        map.next_value::<CheckedString>()?;
                    }
                }
                Ok(PinAnnotations(Labels(pins)))
            }
        }

        deserializer.deserialize_map(PinVisitor)
    }
}

/// The fields of an owner reference the key and the controller lookup read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct OwnerRef<'a> {
    pub(super) api_version: Text<'a>,
    pub(super) kind: Text<'a>,
    pub(super) name: Text<'a>,
    pub(super) controller: Option<bool>,
}

impl OwnerRef<'_> {
    /// The reference as the key's functions take it (`uid` and `blockOwnerDeletion` are not
    /// read there).
    pub(super) fn to_owner_reference(
        &self,
    ) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: self.api_version.as_str().to_owned(),
            kind: self.kind.as_str().to_owned(),
            name: self.name.as_str().to_owned(),
            controller: self.controller,
            ..Default::default()
        }
    }
}

/// A field of an owner reference.
enum OwnerField {
    ApiVersion,
    Kind,
    Name,
    Uid,
    Controller,
    BlockOwnerDeletion,
    Other,
}

impl<'de> Deserialize<'de> for OwnerField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct FieldVisitor;

        impl Visitor<'_> for FieldVisitor {
            type Value = OwnerField;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("field identifier")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(match v {
                    "apiVersion" => OwnerField::ApiVersion,
                    "kind" => OwnerField::Kind,
                    "name" => OwnerField::Name,
                    "uid" => OwnerField::Uid,
                    "controller" => OwnerField::Controller,
                    "blockOwnerDeletion" => OwnerField::BlockOwnerDeletion,
                    _ => OwnerField::Other,
                })
            }
        }

        deserializer.deserialize_identifier(FieldVisitor)
    }
}

/// A string whose value is not kept: only its type is checked.
struct CheckedString;

impl<'de> Deserialize<'de> for CheckedString {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct CheckedVisitor;

        impl Visitor<'_> for CheckedVisitor {
            type Value = CheckedString;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(CheckedString)
            }
        }

        deserializer.deserialize_str(CheckedVisitor)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for OwnerRef<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OwnerVisitor;

        impl<'de> Visitor<'de> for OwnerVisitor {
            type Value = OwnerRef<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("OwnerReference")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut owner = OwnerRef::default();
                while let Some(field) = map.next_key::<OwnerField>()? {
                    match field {
                        OwnerField::ApiVersion => {
                            owner.api_version = map.next_value::<Option<_>>()?.unwrap_or_default();
                        }
                        OwnerField::Kind => {
                            owner.kind = map.next_value::<Option<_>>()?.unwrap_or_default();
                        }
                        OwnerField::Name => {
                            owner.name = map.next_value::<Option<_>>()?.unwrap_or_default();
                        }
                        OwnerField::Controller => owner.controller = map.next_value()?,
                        OwnerField::Uid => {
                            map.next_value::<Option<CheckedString>>()?;
                        }
                        OwnerField::BlockOwnerDeletion => {
                            map.next_value::<Option<bool>>()?;
                        }
                        OwnerField::Other => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(owner)
            }
        }

        const FIELDS: &[&str] = &[
            "apiVersion",
            "blockOwnerDeletion",
            "controller",
            "kind",
            "name",
            "uid",
        ];
        deserializer.deserialize_struct("OwnerReference", FIELDS, OwnerVisitor)
    }
}

/// The first owner reference with `controller: true`, the only one the key reads (the API
/// server allows one); the others are checked and dropped.
#[derive(Debug, Default)]
pub(super) struct Controller<'a>(pub(super) Option<OwnerRef<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for Controller<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OwnersVisitor;

        impl<'de> Visitor<'de> for OwnersVisitor {
            type Value = Controller<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of owner references")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut controller = None;
                while let Some(owner) = seq.next_element::<OwnerRef<'de>>()? {
                    if controller.is_none() && owner.controller == Some(true) {
                        controller = Some(owner);
                    }
                }
                Ok(Controller(controller))
            }
        }

        deserializer.deserialize_seq(OwnersVisitor)
    }
}

#[cfg(test)]
mod tests;
