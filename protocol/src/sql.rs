//! The one database mapping of the vocabulary's enums (feature `sqlx`): each
//! is a PostgreSQL `text` holding its `as_str` name, encoded from and decoded
//! to the enum, so the server never reads or compares the words itself.
//!
//! A stored word this version does not know decodes to an [`UnknownName`]
//! error (the server reports it as corrupt data), never to a default.

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgHasArrayType, PgTypeInfo, PgValueRef};
use sqlx::{Decode, Encode, Postgres, Type};

use crate::{DeviceStatus, Health, OutcomeKind, RunState, Trigger};

/// A stored word that names no value of the enum it was read as.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {name:?}")]
pub struct UnknownName {
    /// What was being read (`device status`, `trigger`, …).
    pub kind: &'static str,
    pub name: String,
}

macro_rules! text_enum {
    ($ty:ty, $kind:literal) => {
        impl Type<Postgres> for $ty {
            fn type_info() -> PgTypeInfo {
                <str as Type<Postgres>>::type_info()
            }

            fn compatible(ty: &PgTypeInfo) -> bool {
                <str as Type<Postgres>>::compatible(ty)
            }
        }

        impl PgHasArrayType for $ty {
            fn array_type_info() -> PgTypeInfo {
                <&str as PgHasArrayType>::array_type_info()
            }

            fn array_compatible(ty: &PgTypeInfo) -> bool {
                <&str as PgHasArrayType>::array_compatible(ty)
            }
        }

        impl Encode<'_, Postgres> for $ty {
            fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
                <&str as Encode<'_, Postgres>>::encode_by_ref(&self.as_str(), buf)
            }
        }

        impl<'r> Decode<'r, Postgres> for $ty {
            fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
                let raw = <&str as Decode<'r, Postgres>>::decode(value)?;
                <$ty>::parse(raw).ok_or_else(|| {
                    Box::new(UnknownName {
                        kind: $kind,
                        name: raw.to_owned(),
                    }) as BoxDynError
                })
            }
        }
    };
}

text_enum!(DeviceStatus, "device status");
text_enum!(Health, "health");
text_enum!(OutcomeKind, "outcome");
text_enum!(Trigger, "trigger");
text_enum!(RunState, "run state");
