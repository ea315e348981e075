S=
